"""Choosing which context rows to recompute at a check layer, shared by the planners.

Two scores, chosen by `EngineConfig.selection`:
- "deviation": CacheBlend's KV deviation ‖fresh − cached‖² of V (or K), summed over heads;
- "question_weighted": that deviation times the attention the question's rows pay to the
  row at the check layer. A row whose KV changed but that the question does not read barely
  moves the answer; measured again later, the two were not told apart, and the default stays
  (docs/benchmarks/recompute.md, "Selection").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.model import ops
from engine.plan import CachedSpan, LayerView, positions


def row_scores(
    view: LayerView, deviation: str, selection: str, question: torch.Tensor
) -> torch.Tensor:
    """Score [m] of every active row; `question`: bool [total] marking the question rows."""
    fresh, cached = (
        (view.fresh_v, view.cached_v) if deviation == "value" else (view.fresh_k, view.cached_k)
    )
    scores = ops.kv_deviation(fresh, cached)
    if selection == "question_weighted":
        if view.attention_from is None:
            raise ValueError("question-weighted selection needs the runner's attention_from")
        asking = question.to(view.active.device)[view.active]
        scores = scores * view.attention_from(asking)
    return scores


def keep_best(
    view: LayerView,
    config: EngineConfig,
    question: torch.Tensor,
    eligible: torch.Tensor,
    count: int,
    spans: Sequence[CachedSpan],
    heads: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices into view.active: every non-eligible row plus `count` eligible rows: the active
    rows under `heads` (bool [total], see `PlanRequest.chunk_heads`) first, then those of
    highest score by `config.deviation` / `config.selection`. With value deviation, fresh V
    under `spans` whose source a lossy codec rounded is rounded alike first (`as_stored`)."""
    if config.deviation == "value":
        view = as_stored(view, spans)
    scores = row_scores(view, config.deviation, config.selection, question)
    if heads is not None:
        scores = scores.masked_fill(heads.to(scores.device)[view.active], float("inf"))
    return keep_top(view, eligible, count, scores)


def as_stored(view: LayerView, spans: Sequence[CachedSpan]) -> LayerView:
    """`view` with the fresh V of each active row under a span whose source has a
    `value_rounding` passed through that rounding (the view itself when there is none).

    The cached V of such a row went through the store's codec, so comparing it with raw fresh
    V adds the codec's noise to every row's deviation, and at 3 bits that noise reorders the
    rows. Rounded alike, a row whose V did not change compares equal, and what is left is the
    change the context made. Keys are left alone: stored K is rotated to new positions after
    loading, so it cannot be rounded the same way here.
    """
    fresh_v = view.fresh_v
    for span in spans:
        rounding = span.source.value_rounding
        if rounding is None:
            continue
        rows = (view.active >= span.start) & (view.active < span.end)
        if not bool(rows.any()):
            continue
        if fresh_v is view.fresh_v:
            fresh_v = fresh_v.clone()
        fresh_v[:, rows] = rounding(fresh_v[:, rows], view.layer)
    return view if fresh_v is view.fresh_v else dataclasses.replace(view, fresh_v=fresh_v)


def keep_top(
    view: LayerView, eligible: torch.Tensor, count: int, scores: torch.Tensor
) -> torch.Tensor:
    """Indices into view.active: every non-eligible row plus the `count` best eligible rows.

    eligible: bool [total] (rows that may be dropped).
    """
    eligible_rows = eligible.to(view.active.device)[view.active]
    keep = ~eligible_rows
    keep[ops.top_rows(scores, count, eligible_rows)] = True
    return positions(keep)
