"""The planner contract: which rows start from cached KV and which rows each layer computes.

A planner turns a request into a `Plan`. The runner executes it layer by layer:
- rows under `cached_spans` start from cached KV (K rotated to its new position);
- rows in `initial_active` are computed from layer 0 on; every other row must be cached;
- at layers where `selects_at(layer)` is true, the runner computes fresh K/V for all active
  rows, shows them next to the cached rows (`LayerView`) and asks `select` which rows stay
  active from this layer on. Fresh K/V of every active row is written either way, so a row
  dropped at layer l keeps its fresh layer-l KV and its cached KV above;
- at layers where `observes(layer)` is true, the runner shows the active rows' queries and
  the layer's cache (`QueryView`) and asks `observe` which rows go on (early termination).
Rows in `pinned` (the question, chunks with no cache) can never be dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.ape import ContextReading
from engine.config import EngineConfig, Fidelity
from engine.kv import ChunkId, KVSource, exact_context
from engine.prompt import PromptLayout
from engine.variant_stats import VariantStats


@dataclass(frozen=True)
class ChunkInput:
    """One retrieved chunk of a request: its id, token ids and cached KV (None: not cached).

    `stats`: Cache-Craft statistics of the variant in `kv` (`cci`, `inter_scores` {chunk id:
    mass}, `token_scores` [per token]), None if never measured.
    """

    chunk_id: ChunkId
    token_ids: tuple[int, ...]
    kv: KVSource | None = None
    stats: VariantStats | None = None


@dataclass(frozen=True)
class ChunkDecision:
    """How a planner treats one chunk, for the prefill report.

    strategy: e.g. "reuse", "partial", "full", "deviation", "computed";
    cfo: the Cache Fix Overhead when one was computed; variant: the context of the variant used.
    """

    strategy: str
    cfo: float | None = None
    variant: tuple[ChunkId, ...] | None = None


@dataclass(frozen=True)
class CachedSpan:
    """Rows [start, start + source.num_tokens) come from `source`, shifted to `start`."""

    start: int
    source: KVSource

    @property
    def end(self) -> int:
        return self.start + self.source.num_tokens

    @property
    def delta(self) -> int:
        return self.start - self.source.base_position


@dataclass(frozen=True)
class PlanRequest:
    """What a planner sees: the layout, the chunks, the exact prefix KV and the knobs."""

    layout: PromptLayout
    chunks: tuple[ChunkInput, ...]
    prefix: KVSource
    ratio: float
    config: EngineConfig
    num_layers: int
    fidelity: Fidelity  # the guard level the request runs at (engine/serving/guard.py)
    # bool [total_len]: context rows the question focuses on, recomputed from layer 0
    # (engine/planners/focus.py); None: no probe ran
    focus: torch.Tensor | None = None
    # how the question's and the answer's rows read the chunks (APE's, engine/ape.py);
    # None: plainly. Every plan of the request runs with it; a re-run by the reference without.
    reading: ContextReading | None = None

    def all_cached_spans(self) -> list[CachedSpan]:
        """The system prefix plus every chunk that has cached KV."""
        spans = [CachedSpan(0, self.prefix)]
        spans += [
            CachedSpan(start, c.kv)
            for c, (start, _) in zip(self.chunks, self.layout.chunk_spans)
            if c.kv is not None
        ]
        return spans

    def pinned_mask(self) -> torch.Tensor:
        """bool [total_len]: the question, every chunk without cached KV and the focus rows."""
        pinned = torch.zeros(self.layout.total_len, dtype=torch.bool)
        qs, qe = self.layout.question_span
        pinned[qs:qe] = True
        for chunk, (start, end) in zip(self.chunks, self.layout.chunk_spans):
            if chunk.kv is None:
                pinned[start:end] = True
        if self.focus is not None:
            pinned |= self.focus
        return pinned

    def question_mask(self) -> torch.Tensor:
        """bool [total_len]: the question rows."""
        mask = torch.zeros(self.layout.total_len, dtype=torch.bool)
        qs, qe = self.layout.question_span
        mask[qs:qe] = True
        return mask

    def chunk_heads(self, tokens: int) -> torch.Tensor:
        """bool [total_len]: the first `tokens` rows of every chunk whose cached KV was computed
        after other chunks than those before it here (a base variant anywhere but first, or a
        variant from another context, or a neighbour-conditioned base anywhere). Such a chunk's
        opening rows read only the system prefix (or other passages) where this prompt puts the
        passages before it."""
        heads = torch.zeros(self.layout.total_len, dtype=torch.bool)
        for i, (chunk, (start, end)) in enumerate(zip(self.chunks, self.layout.chunk_spans)):
            before = tuple(c.chunk_id for c in self.chunks[:i])
            if chunk.kv is not None and (chunk.kv.lead or tuple(chunk.kv.context) != before):
                heads[start : min(end, start + tokens)] = True
        return heads

    def exact_chunks(self, layers_computed: torch.Tensor | None) -> list[bool]:
        """Per chunk, whether a prefill that computed `layers_computed` layers per row left
        its rows exact in this prompt (see `exact_in_context`)."""
        contexts = [exact_context(c.kv) for c in self.chunks]
        return exact_in_context(
            [c.chunk_id for c in self.chunks],
            contexts,
            self.layout.chunk_spans,
            layers_computed,
            self.num_layers,
        )

    def context_mask(self) -> torch.Tensor:
        """bool [total_len]: rows of chunks that have cached KV (candidates for reuse)."""
        mask = torch.zeros(self.layout.total_len, dtype=torch.bool)
        for chunk, (start, end) in zip(self.chunks, self.layout.chunk_spans):
            if chunk.kv is not None:
                mask[start:end] = True
        return mask

    def reusable_mask(self) -> torch.Tensor:
        """bool [total_len]: context rows a plan may reuse: cached, and not focus rows."""
        mask = self.context_mask()
        return mask if self.focus is None else mask & ~self.focus


@dataclass
class LayerView:
    """What `Plan.select` sees at a selecting layer.

    active: [m] positions of the active rows (ascending); fresh_k/fresh_v: their newly
    computed K (after RoPE) and V, [kv_heads, m, head_dim]; cached_k/cached_v: the cached
    rows at the same positions (meaningful where the row lies under a cached span).
    attention_from(rows): attention mass [m] that the active rows `rows` (bool [m]) put on
    each active row at this layer, averaged over heads and those rows (computed on demand).
    """

    layer: int
    active: torch.Tensor
    fresh_k: torch.Tensor
    fresh_v: torch.Tensor
    cached_k: torch.Tensor
    cached_v: torch.Tensor
    attention_from: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class QueryView:
    """What `Plan.observe` sees at an observing layer, after the active rows' queries exist.

    active: [m] positions; q: [heads, m, head_dim] (after RoPE); keys / values:
    [kv_heads, total, head_dim], this layer's assembled cache with the fresh rows written;
    scale: the model's attention scale.
    """

    layer: int
    active: torch.Tensor
    q: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scale: float


@dataclass
class Plan:
    """The executable plan. Subclass and override `selects_at` / `select` to shrink rows."""

    cached_spans: list[CachedSpan]
    initial_active: torch.Tensor  # [m0] positions, ascending
    pinned: torch.Tensor  # bool [total_len]
    # per chunk, when the planner decides chunk by chunk (None: the mode name says it all)
    decisions: list[ChunkDecision] | None = None

    def selects_at(self, layer: int) -> bool:
        return False

    def select(self, layer: int, view: LayerView) -> torch.Tensor | None:
        """Indices into view.active of the rows that stay active; None keeps them all."""
        return None

    def observes(self, layer: int) -> bool:
        return False

    def observe(self, layer: int, view: QueryView) -> torch.Tensor | None:
        """Indices into view.active of the rows that go on past this layer; None keeps all.

        Rows left out stop here (early termination): their fresh K/V of this layer are
        written and their cached KV serves every later layer. They still count as selected.
        """
        return None


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Ascending positions where a bool mask is true."""
    return mask.nonzero().flatten()


def exact_in_context(
    chunk_ids: Sequence[ChunkId],
    contexts: Sequence[tuple[ChunkId, ...] | None],
    spans: Sequence[tuple[int, int]],
    layers_computed: torch.Tensor | None,
    num_layers: int,
) -> list[bool]:
    """Per chunk, whether its rows equal a full prefill's of the same prompt (to float
    tolerance): every chunk before it is exact, and either its cached KV is exact after
    exactly those chunks (contexts[i], from `engine.kv.exact_context`; None: no cached KV, or
    a lossy codec's copy) or every one of its rows ran every layer (a row recomputed over
    exact inputs is exact; a blended one is not)."""
    exact, out = True, []
    for i, (context, (start, end)) in enumerate(zip(contexts, spans)):
        from_exact_source = context is not None and tuple(context) == tuple(chunk_ids[:i])
        computed_fully = layers_computed is not None and bool(
            (layers_computed[start:end] >= num_layers).all()
        )
        exact = exact and (from_exact_source or computed_fully)
        out.append(exact)
    return out
