"""`cachecraft` (Cache-Craft, arXiv 2502.15734): a recompute budget per chunk, and early
termination.

Per chunk, from the statistics of the variant in its `ChunkInput` (see engine/cachecraft):
- identical context, or CFO below `craft_reuse_below`: reuse as is;
- CFO above `craft_full_above`: recompute every token;
- otherwise recompute the ⌈CFO·|chunk|⌉ tokens of highest stored inter-attention, in every layer;
- a variant with no statistics (a base variant seen only alone): plan it like `cacheblend`
  (every row up to the check layer, then the top `ratio`: its first `blend_head_tokens` rows,
  then by the selection score).
From `focus_layer` on, chunks that get less than `focus_threshold` of an even share of the
question's attention stop recomputing; their cached KV serves the remaining layers.

An exact tail (`balanced` only): when the leading chunks are exact in this context (a variant
computed after exactly the chunks before it and kept in a float codec, or no cached KV; see
`engine.kv.exact_context`) and the chunks after them hold
at most `craft_exact_tail` of the context's tokens, those chunks are computed fully ("tail").
The state is then full prefill's, so the guard neither checks nor repairs it and the harvest
keeps every chunk as an exact variant. Why: on the workload's tuning trace (MuSiQue 0-11) the
first-token KL of cachecraft came mostly from requests whose first 4-5 chunks were exact and
whose last one or two were blended (KL 0.35-0.50 at margins over the guard's threshold);
blending such a tail costs its check layers and then, three times in four, a repair that
recomputes the same tail after the first token anyway.
"""

from __future__ import annotations

import math

import torch

from engine.cachecraft.choice import Candidate, variant_cfo
from engine.cachecraft.scores import recompute_count, top_token_offsets
from engine.config import EngineConfig
from engine.kv import ChunkId, exact_context
from engine.model.attention import attention_mass
from engine.plan import (
    ChunkDecision,
    ChunkInput,
    LayerView,
    Plan,
    PlanRequest,
    QueryView,
    positions,
)
from engine.planners.base import BasePlanner, VariantUse, VariantYield
from engine.planners.cacheblend import blend_schedule
from engine.planners.registry import register
from engine.planners.selection import keep_best


@register
class CacheCraftPlanner(BasePlanner):
    name = "cachecraft"
    variant_use = VariantUse.BEST
    leaves = VariantYield.BUILD

    def plan(self, request: PlanRequest) -> Plan:
        pinned = request.pinned_mask()
        fixed = torch.zeros_like(pinned)  # rows recomputed from layer 0 on
        blended = torch.zeros_like(pinned)  # rows planned by deviation at the check layer
        decisions = []
        tail = exact_tail_start(request)
        for i, (chunk, (start, end)) in enumerate(zip(request.chunks, request.layout.chunk_spans)):
            before = tuple(c.chunk_id for c in request.chunks[:i])
            if tail is not None and i >= tail and chunk.kv is not None:
                decisions.append(ChunkDecision("tail", None, tuple(chunk.kv.context)))
                # every row, every layer: early termination may not stop them
                pinned[start:end] = True
                continue
            decision, offsets = self._decide(chunk, before, end - start)
            decisions.append(decision)
            if decision.strategy == "deviation":
                blended[start:end] = True
            elif offsets is not None:
                fixed[start + offsets] = True
        if request.focus is not None:  # focus rows are pinned: never dropped by the blend
            blended &= ~request.focus
        plan = CraftPlan(
            request.all_cached_spans(),
            positions(pinned | fixed | blended),
            pinned,
            decisions=decisions,
        )
        plan.configure(request, self.config, blended)
        return plan

    def _decide(
        self, chunk: ChunkInput, before: tuple[ChunkId, ...], num_tokens: int
    ) -> tuple[ChunkDecision, torch.Tensor | None]:
        """(decision, offsets of the rows to recompute from layer 0, or None)."""
        if chunk.kv is None:
            return ChunkDecision("computed"), None  # pinned: every row, every layer
        context = tuple(chunk.kv.context)
        value = variant_cfo(
            Candidate(context, chunk.stats),
            before,
            self.config.craft_alpha,
            self.config.craft_novelty,
        )
        if value is None:
            return ChunkDecision("deviation", None, context), None
        if value < self.config.craft_reuse_below:
            return ChunkDecision("reuse", value, context), None
        if value > self.config.craft_full_above:
            return ChunkDecision("full", value, context), torch.arange(num_tokens)
        scores = chunk.stats.token_scores if chunk.stats is not None else None
        if not scores or len(scores) != num_tokens:  # no per-token scores: the chunk's first tokens
            scores = [float(num_tokens - t) for t in range(num_tokens)]
        offsets = top_token_offsets(scores, recompute_count(value, num_tokens))
        return ChunkDecision("partial", value, context), offsets


def exact_tail_start(request: PlanRequest) -> int | None:
    """The first chunk of an exact tail (see the module docstring), or None: not `balanced`,
    no leading exact chunk, every chunk exact already, or a tail over `craft_exact_tail`."""
    share = request.config.craft_exact_tail
    if not request.fidelity.guards or share <= 0 or not request.chunks:
        return None
    lead = 0
    for i, chunk in enumerate(request.chunks):
        before = tuple(c.chunk_id for c in request.chunks[:i])
        if chunk.kv is not None and exact_context(chunk.kv) != before:
            break
        lead += 1
    spans = request.layout.chunk_spans
    if lead == 0 or lead == len(spans):
        return None
    tail_tokens, context_tokens = spans[-1][1] - spans[lead][0], spans[-1][1] - spans[0][0]
    return lead if tail_tokens <= share * context_tokens else None


class CraftPlan(Plan):
    def configure(self, request: PlanRequest, config: EngineConfig, blended: torch.Tensor) -> None:
        self.config = config
        self.blended = blended
        self.num_blended = int(blended.sum())
        self.schedule = (
            blend_schedule(config, request.ratio, request.num_layers) if self.num_blended else {}
        )
        self.question = request.question_mask()
        self.heads = request.chunk_heads(config.blend_head_tokens) & blended
        self.spans = request.layout.chunk_spans
        active = torch.zeros_like(self.pinned)
        active[self.initial_active] = True
        # chunks with nothing to stop (reused as is, or pinned) count as stopped already
        self.stopped: set[int] = {
            i
            for i, (start, end) in enumerate(self.spans)
            if not bool((active[start:end] & ~self.pinned[start:end]).any())
        }

    # -- chunks planned by deviation -------------------------------------------------------------

    def selects_at(self, layer: int) -> bool:
        return layer in self.schedule

    def select(self, layer: int, view: LayerView) -> torch.Tensor:
        count = math.ceil(self.schedule[layer] * self.num_blended)
        return keep_best(
            view, self.config, self.question, self.blended, count, self.cached_spans, self.heads
        )

    # -- early termination -------------------------------------------------------------------------

    def observes(self, layer: int) -> bool:
        start = self.config.focus_layer
        return start is not None and layer >= start and len(self.stopped) < len(self.spans)

    def observe(self, layer: int, view: QueryView) -> torch.Tensor | None:
        asking = self.question.to(view.active.device)[view.active]
        mass = attention_mass(view.q[:, asking], view.keys, view.active[asking], view.scale)
        per_chunk = torch.stack([mass[start:end].sum() for start, end in self.spans])
        even = per_chunk.sum() / len(self.spans)
        unfocused = {
            i
            for i, m in enumerate(per_chunk.tolist())
            if m < self.config.focus_threshold * float(even)
        }
        newly = unfocused - self.stopped
        if not newly:
            return None
        self.stopped |= newly
        drop = torch.zeros(self.pinned.numel(), dtype=torch.bool)
        for i in newly:
            drop[self.spans[i][0] : self.spans[i][1]] = True
        drop &= ~self.pinned
        return positions(~drop.to(view.active.device)[view.active])
