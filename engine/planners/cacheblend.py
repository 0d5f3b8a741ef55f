"""`cacheblend` (CacheBlend, arXiv 2405.16444): selective recompute by KV deviation.

Layers below the first check layer run every non-prefix row. At each check layer the fresh
K/V of the active rows is compared with the cached rows, and only the rows of highest
deviation stay active: `ceil(min(1, ratio * multiplier) * context_tokens)` of the context,
plus the pinned rows (question, uncached chunks); the first `blend_head_tokens` rows of each
chunk cached in another context come first in that count. With several check layers and decreasing
multipliers this is the paper's gradual filtering (section 4.3). `EngineConfig.selection`
chooses the score: plain deviation, or deviation weighted by the question's attention.
"""

from __future__ import annotations

import math

import torch

from engine.config import EngineConfig
from engine.plan import CachedSpan, LayerView, Plan, PlanRequest, positions
from engine.planners.base import BasePlanner
from engine.planners.registry import register
from engine.planners.selection import keep_best


@register
class CacheBlendPlanner(BasePlanner):
    name = "cacheblend"

    def plan(self, request: PlanRequest) -> Plan:
        pinned = request.pinned_mask()
        context = request.reusable_mask()
        schedule = blend_schedule(self.config, request.ratio, request.num_layers)
        return BlendPlan(
            request.all_cached_spans(),
            positions(pinned | context),
            pinned,
            eligible=context,
            schedule=schedule,
            config=self.config,
            question=request.question_mask(),
            heads=request.chunk_heads(self.config.blend_head_tokens) & context,
        )


def blend_schedule(config: EngineConfig, ratio: float, num_layers: int) -> dict[int, float]:
    """{check layer: share of the eligible rows kept there}.

    Check layers past the model's last are left out, and the ones left take the last
    multipliers, so from the last check on a model of any depth keeps `ratio` times the last
    multiplier (with the default (1, 2, 6), a 4-layer model checks at 1 and 2 keeping 2r, r)."""
    layers = [layer for layer in config.check_layers if layer < num_layers]
    multipliers = config.check_ratio_multipliers[
        len(config.check_ratio_multipliers) - len(layers) :
    ]
    return {layer: min(1.0, ratio * mult) for layer, mult in zip(layers, multipliers)}


class BlendPlan(Plan):
    """Keeps `ceil(share * |eligible|)` eligible rows at each check layer: `heads` first
    (the opening rows of chunks cached in another context), then by score."""

    def __init__(
        self,
        cached_spans: list[CachedSpan],
        initial_active: torch.Tensor,
        pinned: torch.Tensor,
        *,
        eligible: torch.Tensor,
        schedule: dict[int, float],
        config: EngineConfig,
        question: torch.Tensor,
        heads: torch.Tensor | None = None,
    ):
        super().__init__(cached_spans, initial_active, pinned)
        self.eligible = eligible
        self.num_eligible = int(eligible.sum())
        self.schedule = schedule
        self.config = config
        self.question = question
        self.heads = heads

    def selects_at(self, layer: int) -> bool:
        return layer in self.schedule

    def select(self, layer: int, view: LayerView) -> torch.Tensor:
        count = math.ceil(self.schedule[layer] * self.num_eligible)
        return keep_best(
            view, self.config, self.question, self.eligible, count, self.cached_spans, self.heads
        )
