"""Row scores at a check layer: plain deviation, or deviation weighted by the question's
attention."""

from __future__ import annotations

import dataclasses

import torch

from engine.config import EngineConfig
from engine.kv import ChunkKV
from engine.plan import CachedSpan, LayerView
from engine.planners.selection import as_stored, keep_best, keep_top, row_scores


def make_view(attention: torch.Tensor) -> LayerView:
    fresh_v = torch.zeros(2, 5, 4)
    cached_v = torch.zeros(2, 5, 4)
    cached_v[:, :, 0] = torch.tensor([1.0, 3.0, 2.0, 0.5, 0.0])  # deviation = 2 * d^2 per row
    return LayerView(
        1,
        torch.arange(10, 15),
        fresh_v.clone(),
        fresh_v,
        torch.zeros(2, 5, 4),
        cached_v,
        attention_from=lambda rows: attention,
    )


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


def _source(rounding=None) -> ChunkKV:
    """A 4-token cached chunk (its KV is not read here), its V rounded by `rounding`."""
    return ChunkKV((1,) * 4, torch.zeros(1, 2, 2, 4, 4), 0, "fp", "p", value_rounding=rounding)


def _to_halves(v: torch.Tensor, layer: int = 2) -> torch.Tensor:
    """A coarse codec at layer 2 (the views' layer): V rounded to multiples of 0.5; every
    other layer is kept exact."""
    return (v * 2).round() / 2 if layer == 2 else v


def _noisy_view() -> tuple[LayerView, torch.Tensor]:
    """Rows 10-13 cached through the coarse codec, row 14 the question. Only row 11 changed,
    in one element (0.2 -> 0.3, across a rounding boundary); row 10 is unchanged but the
    codec's error on its 8 elements (0.24 each) outweighs that change."""
    base = torch.zeros(2, 5, 4)
    base[:, 0] = 0.24
    base[0, 1, 0] = 0.2
    base[:, 3] = 0.1
    fresh_v = base.clone()
    fresh_v[0, 1, 0] = 0.3
    eligible = torch.zeros(15, dtype=torch.bool)
    eligible[10:14] = True
    return LayerView(
        2, torch.arange(10, 15), fresh_v.clone(), fresh_v, torch.zeros(2, 5, 4), _to_halves(base)
    ), eligible


def test_fresh_values_are_rounded_like_the_cached_ones_before_comparing():
    view, eligible = _noisy_view()
    config = EngineConfig(selection="deviation")
    question = torch.zeros(15, dtype=torch.bool)
    question[14] = True
    spans = [CachedSpan(10, _source(_to_halves))]
    raw = row_scores(view, "value", "deviation", question)
    assert raw[0] > raw[1] > raw[3] > 0  # the codec's error alone outranks the one real change
    assert keep_best(view, config, question, eligible, 1, []).tolist() == [0, 4]
    rounded = as_stored(view, spans)
    # rounded as that layer is stored
    at_layer_3 = as_stored(dataclasses.replace(view, layer=3), spans)
    assert torch.equal(at_layer_3.fresh_v, view.fresh_v) and not torch.equal(
        rounded.fresh_v, view.fresh_v
    )
    # the question row is not under the span
    assert torch.equal(view.fresh_v[:, 4], rounded.fresh_v[:, 4])
    torch.testing.assert_close(
        row_scores(rounded, "value", "deviation", question), torch.tensor([0, 0.25, 0, 0, 0])
    )
    assert keep_best(view, config, question, eligible, 1, spans).tolist() == [1, 4]


def test_sources_without_rounding_leave_the_view_alone():
    view, _ = _noisy_view()
    assert as_stored(view, [CachedSpan(10, _source())]) is view
    assert as_stored(view, [CachedSpan(0, _source(_to_halves))]) is view  # rows 0-3: none active


def test_head_rows_come_first_and_count_in_the_budget():
    view = make_view(torch.ones(5))
    eligible = torch.zeros(15, dtype=torch.bool)
    eligible[10:14] = True
    heads = torch.zeros(15, dtype=torch.bool)
    heads[13] = True  # the row of lowest deviation but one
    config = EngineConfig(selection="deviation")
    question = torch.zeros(15, dtype=torch.bool)
    assert keep_best(view, config, question, eligible, 2, [], heads).tolist() == [1, 3, 4]
    assert keep_best(view, config, question, eligible, 2, []).tolist() == [1, 2, 4]
    # ratio 0: none
    assert keep_best(view, config, question, eligible, 0, [], heads).tolist() == [4]
