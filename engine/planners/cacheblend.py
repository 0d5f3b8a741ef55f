"""`cacheblend` (CacheBlend, arXiv 2405.16444): selective recompute by KV deviation.

Layers below the first check layer run every non-prefix row. At each check layer the fresh
K/V of the active rows is compared with the cached rows, and only the rows of highest
deviation stay active: `ceil(min(1, ratio * multiplier) * context_tokens)` of the context,
plus the pinned rows (question, uncached chunks). With several check layers and decreasing
multipliers this is the paper's gradual filtering (section 4.3).
"""

from __future__ import annotations

import math

import torch

from engine import ops
from engine.planners import register
from engine.planners.base import BasePlanner, LayerView, Plan, PlanRequest, positions


@register
class CacheBlendPlanner(BasePlanner):
    name = "cacheblend"

    def plan(self, request: PlanRequest) -> Plan:
        pinned = request.pinned_mask()
        context = request.context_mask()
        active = positions(pinned | context)
        schedule = {layer: min(1.0, request.ratio * mult)
                    for layer, mult in zip(self.config.check_layers, self.config.check_ratio_multipliers)
                    if layer < request.num_layers}
        return BlendPlan(request.all_cached_spans(), active, pinned, context=context,
                         schedule=schedule, deviation=self.config.deviation)


class BlendPlan(Plan):
    def __init__(self, cached_spans, initial_active, pinned, *, context: torch.Tensor,
                 schedule: dict[int, float], deviation: str):
        super().__init__(cached_spans, initial_active, pinned)
        self.context = context
        self.num_context = int(context.sum())
        self.schedule = schedule
        self.deviation = deviation

    def selects_at(self, layer: int) -> bool:
        return layer in self.schedule

    def select(self, layer: int, view: LayerView) -> torch.Tensor:
        eligible = self.context.to(view.active.device)[view.active]
        fresh, cached = ((view.fresh_v, view.cached_v) if self.deviation == "value"
                         else (view.fresh_k, view.cached_k))
        count = math.ceil(self.schedule[layer] * self.num_context)
        chosen = ops.deviation_top_rows(fresh, cached, count, eligible)
        keep = ~eligible
        keep[chosen] = True
        return positions(keep)
