"""Row scores at a check layer: plain deviation, or deviation weighted by the question's attention."""

from __future__ import annotations

import torch

from engine.plan import LayerView
from engine.planners.selection import keep_top, row_scores


def make_view(attention: torch.Tensor) -> LayerView:
    fresh_v = torch.zeros(2, 5, 4)
    cached_v = torch.zeros(2, 5, 4)
    cached_v[:, :, 0] = torch.tensor([1.0, 3.0, 2.0, 0.5, 0.0])  # deviation = 2 * d^2 per row
    return LayerView(1, torch.arange(10, 15), fresh_v.clone(), fresh_v, torch.zeros(2, 5, 4), cached_v,
                     attention_from=lambda rows: attention)


def test_deviation_scores_sum_squares_over_heads_and_dims():
    view = make_view(torch.ones(5))
    question = torch.zeros(15, dtype=torch.bool)
    scores = row_scores(view, "value", "deviation", question)
    torch.testing.assert_close(scores, 2 * torch.tensor([1.0, 9.0, 4.0, 0.25, 0.0]))


def test_question_weighting_multiplies_by_attention():
    attention = torch.tensor([0.5, 0.0, 0.1, 1.0, 0.2])
    view = make_view(attention)
    question = torch.zeros(15, dtype=torch.bool)
    question[14] = True
    scores = row_scores(view, "value", "question_weighted", question)
    torch.testing.assert_close(scores, 2 * torch.tensor([1.0, 9.0, 4.0, 0.25, 0.0]) * attention)


def test_keep_top_keeps_ineligible_rows_and_the_best_eligible_ones():
    view = make_view(torch.ones(5))
    eligible = torch.zeros(15, dtype=torch.bool)
    eligible[10:14] = True  # row 14 (the question) is not eligible
    keep = keep_top(view, eligible, 2, torch.tensor([1.0, 9.0, 4.0, 0.25, 0.0]))
    assert keep.tolist() == [1, 2, 4]
