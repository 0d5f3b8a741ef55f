"""bench/workload/summary.py: the decode rate counts time in which any request decoded, once."""

from __future__ import annotations

import math

import pytest
import torch

from bench.workload.cell import RequestFacts
from bench.workload.summary import decode_tokens_per_s


def facts(generated: int, decoding: tuple[float, float] | None) -> RequestFacts:
    return RequestFacts(
        0, (1,), "answer", generated, torch.zeros(4), 0.1, 0.1, 1.0, 0.0, 0, decoding=decoding
    )


def test_overlapping_spans_count_their_union_once():
    # spans [0, 2] and [1, 3] overlap: 3 s of decoding; [5, 6] adds 1 s; tokens after the first:
    # 4 + 6 + 2
    cell = [facts(5, (0.0, 2.0)), facts(7, (1.0, 3.0)), facts(3, (5.0, 6.0))]
    assert decode_tokens_per_s(cell) == pytest.approx(12 / 4)


def test_a_span_inside_another_adds_no_time():
    assert decode_tokens_per_s([facts(11, (0.0, 10.0)), facts(11, (2.0, 3.0))]) == pytest.approx(
        20 / 10
    )


def test_one_token_answers_and_unstreamed_answers_are_left_out():
    assert decode_tokens_per_s(
        [facts(9, (0.0, 2.0)), facts(1, (0.0, 50.0)), facts(30, None)]
    ) == pytest.approx(4.0)
    assert math.isnan(decode_tokens_per_s([facts(1, (0.0, 1.0))]))
