"""The layer loop: executes a Plan over the decoder, one layer at a time.

Per layer: copy the cached rows into the request's cache (K rotated to its new positions),
compute K/V of the active rows, let the plan drop rows at its selecting layers, then run
attention (exact causal mask by absolute position) and the MLP for the rows still active.
The runner knows nothing about modes; planners decide everything through the Plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from engine.ape import ContextReading
from engine.kv import KVCache
from engine.model import ops
from engine.model.attention import QueryLayout, attention_mass
from engine.model.layers import DecoderStack
from engine.model.work import WorkMeter
from engine.plan import LayerView, Plan, QueryView


@dataclass
class RunOutput:
    """The assembled cache, the last row's logits and what each row went through.

    layers_computed: [total] number of layers that ran attention + MLP for each row.
    selected: bool [total], rows active after the plan's last selection (rows that stopped
    early by the plan's `observe` still count as selected).
    stopped_layer: [total] the layer at which `observe` stopped a row; -1 if it never did.
    """

    cache: KVCache
    logits: torch.Tensor | None  # [vocab] float32 for the last prompt row
    layers_computed: torch.Tensor
    selected: torch.Tensor
    stopped_layer: torch.Tensor


@dataclass
class _Rows:
    """The active rows at some point of the loop and what depends only on their positions.

    active: [m] positions (active_cpu: the same on the CPU); hidden: [m, hidden];
    cos/sin: [m, head_dim] RoPE tables; queries: how they attend. All but `hidden` are
    rebuilt only when the active set changes.
    """

    active: torch.Tensor
    active_cpu: torch.Tensor
    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    queries: QueryLayout

    def keep(self, index: torch.Tensor, num_keys: int) -> _Rows:
        active = self.active[index]
        return _Rows(
            active,
            active.cpu(),
            self.hidden[index],
            self.cos[index],
            self.sin[index],
            QueryLayout(active, num_keys, self.hidden.dtype),
        )

    def with_hidden(self, hidden: torch.Tensor) -> _Rows:
        return _Rows(self.active, self.active_cpu, hidden, self.cos, self.sin, self.queries)


class LayerRunner:
    def __init__(
        self,
        stack: DecoderStack,
        meter: WorkMeter | None = None,
        pause_point: Callable[[], None] | None = None,
    ):
        self.stack = stack
        # every run's layer-rows, for benchmarks that charge all work
        self.meter = meter or WorkMeter()
        # called between two layers and between two blocks of a layer's rows (`row_blocks`),
        # where other work may run (the decode scheduler's `interleave`); it must leave this
        # run's tensors alone
        self.pause_point = pause_point

    def run(
        self,
        ids: torch.Tensor,
        plan: Plan,
        capacity: int,
        want_logits: bool = True,
        last_layer: int | None = None,
        reading: ContextReading | None = None,
    ) -> RunOutput:
        """Prefill `ids` [total] by `plan` into a new cache of `capacity` rows.

        `last_layer` stops after that layer (statistics passes); logits need every layer.
        `reading`: rows after the contexts read them by APE (engine/ape.py), in this
        prefill and in every decode step from its cache (`KVCache.reading`).
        """
        total, spec = ids.numel(), self.stack.spec
        _check_plan(plan, total)
        num_layers = spec.num_layers if last_layer is None else last_layer + 1
        weights = self.stack.embed_tokens.weight
        cache = KVCache(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, capacity, weights.dtype, ids.device
        )
        cache.reading = reading
        rows = self._initial_rows(ids, plan.initial_active.to(ids.device), total)
        book = _Bookkeeping(total, plan.initial_active)
        for layer in range(num_layers):
            self._fill_cached(cache, plan, layer, book.is_active)
            rows = self._run_layer(layer, cache, plan, rows, total, book)
            book.layer_done(rows.active_cpu)
            if self.pause_point is not None and layer + 1 < num_layers:
                self.pause_point()
        cache.length = total
        self.meter.add(book.computed)
        logits = (
            self.stack.logits(rows.hidden[-1:])[0]
            if want_logits and num_layers == spec.num_layers
            else None
        )
        return RunOutput(cache, logits, book.computed, book.selected, book.stopped_layer)

    def _initial_rows(self, ids: torch.Tensor, active: torch.Tensor, total: int) -> _Rows:
        hidden = self.stack.embed(ids[active])
        cos, sin = self.stack.rope_tables(active, hidden)
        return _Rows(
            active, active.cpu(), hidden, cos, sin, QueryLayout(active, total, hidden.dtype)
        )

    def _fill_cached(self, cache: KVCache, plan: Plan, layer: int, is_active: torch.Tensor) -> None:
        """Copy this layer of every cached span into the cache, K shifted to its new place.

        A span whose rows are all active is skipped unless the plan compares against it.
        """
        compares = plan.selects_at(layer)
        for span in plan.cached_spans:
            if not compares and bool(is_active[span.start : span.end].all()):
                continue
            rows = cache.data[layer, :, :, span.start : span.end]  # [2, kv_heads, n, head_dim]
            rows.copy_(span.source.layer(layer))
            ops.rope_shift_(rows[0], span.delta, self.stack.inv_freq)

    def _run_layer(
        self, layer: int, cache: KVCache, plan: Plan, rows: _Rows, total: int, book: _Bookkeeping
    ) -> _Rows:
        stack, active = self.stack, rows.active
        x = stack.input_norm(layer, rows.hidden)
        k, v = stack.project_kv(layer, x, rows.cos, rows.sin)
        keep = None
        selects = plan.selects_at(layer)
        if selects:  # selection: compare fresh and cached rows
            cached = ops.gather_rows(cache.data[layer], active)  # [2, kv_heads, m, head_dim]
        ops.scatter_rows_(cache.data[layer, 0], active, k)
        ops.scatter_rows_(cache.data[layer, 1], active, v)
        if selects:
            attention_from = partial(self._attention_from, layer, x, rows, cache.keys(layer, total))
            keep = plan.select(
                layer, LayerView(layer, active, k, v, cached[0], cached[1], attention_from)
            )
        if keep is not None:
            rows, x = self._keep(plan, rows, x, keep, total)
            book.dropped(rows.active_cpu)
        q = stack.project_q(layer, x, rows.cos, rows.sin)
        keys, values = cache.keys(layer, total), cache.values(layer, total)
        if plan.observes(layer):  # early termination: the plan sees this layer's queries
            keep = plan.observe(layer, QueryView(layer, rows.active, q, keys, values, stack.scale))
            if keep is not None:
                q = q[:, keep.to(q.device)]
                rows, x = self._keep(plan, rows, x, keep, total)
                book.stopped(rows.active_cpu, layer)
        hidden = stack.attend_and_mlp(
            layer, rows.hidden, q, keys, values, rows.queries, self.pause_point, cache.reading
        )
        return rows.with_hidden(hidden)

    def _attention_from(
        self, layer: int, x: torch.Tensor, rows: _Rows, keys: torch.Tensor, which: torch.Tensor
    ) -> torch.Tensor:
        """Attention mass [m] that the active rows `which` (bool [m]) put on each active row."""
        which = which.to(x.device)
        q = self.stack.project_q(layer, x[which], rows.cos[which], rows.sin[which])
        return attention_mass(q, keys, rows.active[which], self.stack.scale)[rows.active]

    @staticmethod
    def _keep(
        plan: Plan, rows: _Rows, x: torch.Tensor, keep: torch.Tensor, total: int
    ) -> tuple[_Rows, torch.Tensor]:
        keep = keep.to(rows.active.device)
        _check_keep(plan, rows.active, keep)
        return rows.keep(keep, total), x[keep]


class _Bookkeeping:
    """Per-row facts of one run, kept on the CPU so that no decision waits on the GPU."""

    def __init__(self, total: int, initial_active: torch.Tensor):
        self.is_active = torch.zeros(total, dtype=torch.bool)
        self.is_active[initial_active.cpu()] = True
        self.selected = self.is_active.clone()
        self.computed = torch.zeros(total, dtype=torch.long)
        self.stopped_layer = torch.full((total,), -1, dtype=torch.long)

    def dropped(self, still_active: torch.Tensor) -> None:
        """A selection kept only `still_active`: the others are no longer selected."""
        self.selected.zero_()
        self.selected[still_active] = True
        self._set_active(still_active)

    def stopped(self, still_active: torch.Tensor, layer: int) -> None:
        """Early termination at `layer`: rows not in `still_active` stop, still selected."""
        gone = self.is_active.clone()
        gone[still_active] = False
        self.stopped_layer[gone] = layer
        self._set_active(still_active)

    def layer_done(self, active: torch.Tensor) -> None:
        self.computed[active] += 1

    def _set_active(self, active: torch.Tensor) -> None:
        self.is_active.zero_()
        self.is_active[active] = True


def _check_plan(plan: Plan, total: int) -> None:
    """Every row must be computed from layer 0 or covered by a cached span; the last row active."""
    covered = torch.zeros(total, dtype=torch.bool)
    for span in plan.cached_spans:
        covered[span.start : span.end] = True
    covered[plan.initial_active.cpu()] = True
    if not bool(covered.all()):
        raise AssertionError("plan leaves rows neither cached nor computed")
    if plan.initial_active.numel() == 0 or int(plan.initial_active[-1]) != total - 1:
        raise AssertionError("plan must compute the last prompt row")


def _check_keep(plan: Plan, active: torch.Tensor, keep: torch.Tensor) -> None:
    kept = torch.zeros(active.numel(), dtype=torch.bool, device=active.device)
    kept[keep] = True
    if bool((plan.pinned.to(active.device)[active] & ~kept).any()):
        raise AssertionError("plan dropped a pinned row")
