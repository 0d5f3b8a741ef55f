"""`epic` (EPIC / LegoLink): recompute the first k tokens of every chunk in every layer.

The first tokens of a chunk computed alone act as an attention sink for it; recomputing
them in context restores most of the damage at a fixed, position-independent cost.
k is `EngineConfig.epic_tokens`.

On SmolLM2 that damage is small, and epic is not reliably nearer to full than `naive`
(docs/benchmarks/recompute.md, "epic"): the model, not a defect, since with k past every
chunk's length epic equals full (tests/engine/test_fidelity_exact.py).
"""

from engine.plan import Plan, PlanRequest, positions
from engine.planners.base import BasePlanner
from engine.planners.registry import register


@register
class EpicPlanner(BasePlanner):
    name = "epic"

    def plan(self, request: PlanRequest) -> Plan:
        pinned = request.pinned_mask()
        active = pinned.clone()
        k = self.config.epic_tokens
        for start, end in request.layout.chunk_spans:
            active[start : min(end, start + k)] = True
        return Plan(
            cached_spans=request.all_cached_spans(), initial_active=positions(active), pinned=pinned
        )
