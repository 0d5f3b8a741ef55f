"""`naive`: reuse every cached chunk with its positions fixed; compute only the question.

Cross-chunk attention is lost entirely, so this is the lower bound on fidelity.
"""

from engine.plan import Plan, PlanRequest, positions
from engine.planners.base import BasePlanner
from engine.planners.registry import register


@register
class NaivePlanner(BasePlanner):
    name = "naive"

    def plan(self, request: PlanRequest) -> Plan:
        pinned = request.pinned_mask()
        return Plan(
            cached_spans=request.all_cached_spans(), initial_active=positions(pinned), pinned=pinned
        )
