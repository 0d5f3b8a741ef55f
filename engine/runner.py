"""The layer loop: executes a Plan over the decoder, one layer at a time.

Per layer: copy the cached rows into the request's cache (K rotated to its new positions),
compute K/V of the active rows, let the plan drop rows at its selecting layers, then run
attention (exact causal mask by absolute position) and the MLP for the rows still active.
The runner knows nothing about modes; planners decide everything through the Plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import ops
from engine.attention import QueryLayout
from engine.kv import KVCache
from engine.layers import DecoderStack
from engine.planners.base import LayerView, Plan


@dataclass
class RunOutput:
    """The assembled cache, the last row's logits and what each row went through.

    layers_computed: [total] number of layers that ran attention + MLP for each row.
    selected: bool [total], rows still active after the plan's last selection.
    """

    cache: KVCache
    logits: torch.Tensor | None  # [vocab] float32 for the last prompt row
    layers_computed: torch.Tensor
    selected: torch.Tensor


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

    def keep(self, index: torch.Tensor, num_keys: int) -> "_Rows":
        active = self.active[index]
        return _Rows(active, active.cpu(), self.hidden[index], self.cos[index], self.sin[index],
                     QueryLayout(active, num_keys, self.hidden.dtype))

    def with_hidden(self, hidden: torch.Tensor) -> "_Rows":
        return _Rows(self.active, self.active_cpu, hidden, self.cos, self.sin, self.queries)


class LayerRunner:
    def __init__(self, stack: DecoderStack):
        self.stack = stack

    def run(self, ids: torch.Tensor, plan: Plan, capacity: int, want_logits: bool = True) -> RunOutput:
        """Prefill `ids` [total] by `plan` into a new cache of `capacity` rows."""
        total, spec = ids.numel(), self.stack.spec
        device = ids.device
        _check_plan(plan, total)
        weights = self.stack.embed_tokens.weight
        cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, capacity, weights.dtype, device)
        active = plan.initial_active.to(device)
        rows = self._initial_rows(ids, active, total)
        # bookkeeping stays on the CPU: the fill decision must not wait on the GPU
        is_active = torch.zeros(total, dtype=torch.bool)
        is_active[plan.initial_active] = True
        computed = torch.zeros(total, dtype=torch.long)
        for layer in range(spec.num_layers):
            self._fill_cached(cache, plan, layer, is_active)
            before = rows.active_cpu
            rows = self._run_layer(layer, cache, plan, rows, total)
            if rows.active_cpu is not before:
                is_active.zero_()
                is_active[rows.active_cpu] = True
            computed[is_active] += 1
        cache.length = total
        logits = self.stack.logits(rows.hidden[-1:])[0] if want_logits else None
        return RunOutput(cache, logits, computed, is_active.clone())

    def _initial_rows(self, ids: torch.Tensor, active: torch.Tensor, total: int) -> _Rows:
        hidden = self.stack.embed(ids[active])
        cos, sin = self.stack.rope_tables(active, hidden)
        return _Rows(active, active.cpu(), hidden, cos, sin, QueryLayout(active, total, hidden.dtype))

    def _fill_cached(self, cache: KVCache, plan: Plan, layer: int, is_active: torch.Tensor) -> None:
        """Copy this layer of every cached span into the cache, K shifted to its new place.

        A span whose rows are all active is skipped unless the plan compares against it.
        """
        compares = plan.selects_at(layer)
        for span in plan.cached_spans:
            if not compares and bool(is_active[span.start:span.end].all()):
                continue
            rows = cache.data[layer, :, :, span.start:span.end]  # [2, kv_heads, n, head_dim]
            rows.copy_(span.source.layer(layer))
            ops.rope_shift_(rows[0], span.delta, self.stack.inv_freq)

    def _run_layer(self, layer: int, cache: KVCache, plan: Plan, rows: _Rows, total: int) -> _Rows:
        stack, active = self.stack, rows.active
        x = stack.input_norm(layer, rows.hidden)
        k, v = stack.project_kv(layer, x, rows.cos, rows.sin)
        keep = None
        if plan.selects_at(layer):
            cached = ops.gather_rows(cache.data[layer], active)  # [2, kv_heads, m, head_dim]
            keep = plan.select(layer, LayerView(layer, active, k, v, cached[0], cached[1]))
        ops.scatter_rows_(cache.data[layer, 0], active, k)
        ops.scatter_rows_(cache.data[layer, 1], active, v)
        if keep is not None:
            keep = keep.to(active.device)
            _check_keep(plan, active, keep)
            rows, x = rows.keep(keep, total), x[keep]
        q = stack.project_q(layer, x, rows.cos, rows.sin)
        hidden = stack.attend_and_mlp(layer, rows.hidden, q, cache.keys(layer, total),
                                      cache.values(layer, total), rows.queries)
        return rows.with_hidden(hidden)


def _check_plan(plan: Plan, total: int) -> None:
    """Every row must be computed from layer 0 or covered by a cached span; the last row active."""
    covered = torch.zeros(total, dtype=torch.bool)
    for span in plan.cached_spans:
        covered[span.start:span.end] = True
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
