"""Choosing which context rows to recompute at a check layer, shared by the planners.

Two scores, chosen by `EngineConfig.selection`:
- "deviation": CacheBlend's KV deviation ‖fresh − cached‖² of V (or K), summed over heads;
- "question_weighted": that deviation times the attention the question's rows pay to the
  row at the check layer. A row whose KV changed but that the question does not read barely
  moves the answer; on SmolLM2 / MuSiQue this halved the first-token KL at r = 0.15 when it
  was introduced. Measured again on records 0-99 (6 chunks cut to 256 tokens, cold base
  variants, cacheblend at `fast`, r = 0.15, check layers 1 and 2): mean KL 0.225 weighted
  against 0.207 plain (paired difference −0.018 ± 0.013 for plain: no significant
  difference either way); V and K deviation summed gave 0.207 too. The default stays.
"""

from __future__ import annotations

import torch

from engine import ops
from engine.config import EngineConfig
from engine.plan import LayerView, positions

def row_scores(view: LayerView, deviation: str, selection: str, question: torch.Tensor) -> torch.Tensor:
    """Score [m] of every active row; `question`: bool [total] marking the question rows."""
    fresh, cached = ((view.fresh_v, view.cached_v) if deviation == "value" else (view.fresh_k, view.cached_k))
    scores = ops.kv_deviation(fresh, cached)
    if selection == "question_weighted":
        if view.attention_from is None:
            raise ValueError("question-weighted selection needs the runner's attention_from")
        asking = question.to(view.active.device)[view.active]
        scores = scores * view.attention_from(asking)
    return scores


def keep_best(view: LayerView, config: EngineConfig, question: torch.Tensor, eligible: torch.Tensor,
              count: int) -> torch.Tensor:
    """Indices into view.active: every non-eligible row plus the `count` eligible rows of
    highest score by `config.deviation` / `config.selection`."""
    return keep_top(view, eligible, count, row_scores(view, config.deviation, config.selection, question))


def keep_top(view: LayerView, eligible: torch.Tensor, count: int, scores: torch.Tensor) -> torch.Tensor:
    """Indices into view.active: every non-eligible row plus the `count` best eligible rows.

    eligible: bool [total] (rows that may be dropped).
    """
    eligible_rows = eligible.to(view.active.device)[view.active]
    keep = ~eligible_rows
    keep[ops.top_rows(scores, count, eligible_rows)] = True
    return positions(keep)
