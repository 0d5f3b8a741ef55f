"""Choosing which context rows to recompute at a check layer, shared by the planners.

Two scores, chosen by `EngineConfig.selection`:
- "deviation": CacheBlend's KV deviation ‖fresh − cached‖² of V (or K), summed over heads;
- "question_weighted": that deviation times the attention the question's rows pay to the
  row at the check layer. A row whose KV changed but that the question does not read barely
  moves the answer; on SmolLM2 / MuSiQue this halves the first-token KL at r = 0.15.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine import ops
from engine.config import EngineConfig
from engine.planners.base import LayerView, positions

def row_scores(view: LayerView, deviation: str, selection: str, question: torch.Tensor) -> torch.Tensor:
    """Score [m] of every active row; `question`: bool [total] marking the question rows."""
    fresh, cached = ((view.fresh_v, view.cached_v) if deviation == "value" else (view.fresh_k, view.cached_k))
    scores = ops.kv_deviation(fresh, cached)
    if selection == "question_weighted":
        asking = question.to(view.active.device)[view.active]
        scores = scores * view.attention_from(asking)
    return scores


def keep_best(view: LayerView, config: EngineConfig, question: torch.Tensor, eligible: torch.Tensor,
              count: int) -> torch.Tensor:
    """Indices into view.active: every non-eligible row plus the `count` eligible rows of
    highest score by `config.deviation` / `config.selection`, or more when
    `config.guard_coverage` > 0 asks the kept rows to cover that share of the score mass."""
    return keep_best_measured(view, config, question, eligible, count).keep


class Kept(NamedTuple):
    """keep: indices into view.active of the rows that stay; uncovered: share of the eligible
    rows' score mass on the rows dropped (0 when nothing is eligible)."""

    keep: torch.Tensor
    uncovered: float


def keep_best_measured(view: LayerView, config: EngineConfig, question: torch.Tensor,
                       eligible: torch.Tensor, count: int) -> Kept:
    """`keep_best`, and how much of the score mass the dropped rows carry (the guard's estimate)."""
    scores = row_scores(view, config.deviation, config.selection, question)
    eligible_rows = eligible.to(view.active.device)[view.active]
    if config.guard_coverage > 0:
        count = max(count, covering_count(scores[eligible_rows], config.guard_coverage))
    keep = keep_top(view, eligible, count, scores)
    return Kept(keep, uncovered_share(scores, eligible_rows, view.active.numel(), keep))


def covering_count(scores: torch.Tensor, coverage: float) -> int:
    """The fewest rows whose highest scores add up to `coverage` of the total (all if it is 0)."""
    if scores.numel() == 0:
        return 0
    ranked = scores.double().clamp_min(0).sort(descending=True).values.cumsum(0)
    total = float(ranked[-1])
    if total <= 0:
        return 0
    # rows before the one whose running sum reaches the target (within float32 rounding), plus that row
    return min(scores.numel(), int((ranked < coverage * total * (1 - 1e-6)).sum()) + 1)


def uncovered_share(scores: torch.Tensor, eligible_rows: torch.Tensor, num_active: int, keep: torch.Tensor) -> float:
    """Share of the eligible rows' score mass on eligible rows outside `keep`."""
    dropped = eligible_rows.clone()
    dropped[keep] = False
    total = float(scores[eligible_rows].double().clamp_min(0).sum())
    return float(scores[dropped].double().clamp_min(0).sum()) / total if total > 0 else 0.0


def keep_top(view: LayerView, eligible: torch.Tensor, count: int, scores: torch.Tensor) -> torch.Tensor:
    """Indices into view.active: every non-eligible row plus the `count` best eligible rows.

    eligible: bool [total] (rows that may be dropped).
    """
    eligible_rows = eligible.to(view.active.device)[view.active]
    keep = ~eligible_rows
    keep[ops.top_rows(scores, count, eligible_rows)] = True
    return positions(keep)
