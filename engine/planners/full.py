"""`full`: the reference prefill of the whole prompt; ignores every cache, even the prefix."""

import torch

from engine.plan import Plan, PlanRequest
from engine.planners.base import BasePlanner
from engine.planners.registry import register


@register
class FullPlanner(BasePlanner):
    name = "full"
    reuses_cache = False
    exact = True

    def plan(self, request: PlanRequest) -> Plan:
        total = request.layout.total_len
        return Plan(
            cached_spans=[],
            initial_active=torch.arange(total),
            pinned=torch.ones(total, dtype=torch.bool),
        )
