"""`epic` (EPIC / LegoLink): recompute the first k tokens of every chunk in every layer.

The first tokens of a chunk computed alone act as an attention sink for it; recomputing
them in context restores most of the damage at a fixed, position-independent cost.
k is `EngineConfig.epic_tokens`.

On SmolLM2 that damage is small, and epic is not reliably nearer to full than `naive`: on
MuSiQue 100-119 (6 whole passages, base variants, at `fast`) mean first-token KL naive 0.312;
epic k = 1: 0.306, 4: 0.323, 16: 0.326, 64: 0.289, paired differences from naive -0.006 +-
0.010, +0.011 +- 0.014, +0.013 +- 0.018, -0.023 +- 0.020 (none significant), epic worse on
9-10 of 20 records at k <= 16 and lower in median at every k (0.186 against 0.201 at k = 16).
The worse mean comes from a few records (KL 1.31 -> 1.55 on one): the model, not a defect,
since with k past every chunk's length epic equals full (tests/engine/test_fidelity_exact.py).
"""

from engine.planners import register
from engine.planners.base import BasePlanner
from engine.plan import Plan, PlanRequest, positions


@register
class EpicPlanner(BasePlanner):
    name = "epic"

    def plan(self, request: PlanRequest) -> Plan:
        pinned = request.pinned_mask()
        active = pinned.clone()
        k = self.config.epic_tokens
        for start, end in request.layout.chunk_spans:
            active[start:min(end, start + k)] = True
        return Plan(cached_spans=request.all_cached_spans(), initial_active=positions(active), pinned=pinned)
