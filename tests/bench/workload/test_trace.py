"""The trace: generation, files, and the reuse statistics measured on retrieved chunk lists."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.workload.trace import TraceRequest, generate_trace, read_trace, trace_stats, write_trace
from engine.errors import InvalidRequest

QUESTIONS = [f"Where was person number {i} born and educated?" for i in range(20)]


def test_generated_trace_is_reproducible_and_zipf_shaped():
    a = generate_trace(QUESTIONS, 400, seed=3)
    assert a == generate_trace(QUESTIONS, 400, seed=3)
    assert a != generate_trace(QUESTIONS, 400, seed=4)
    counts = Counter(r.need for r in a).most_common()
    # Zipf(1) over 20: the most popular need is asked several times as often as the median one
    assert counts[0][1] >= 4 * counts[len(counts) // 2][1]


def test_only_repeats_are_reformulated_and_they_keep_the_need():
    trace = generate_trace(QUESTIONS, 200, seed=1, reformulate=1.0)
    seen = set()
    for request in trace:
        assert request.reformulated == (request.need in seen)
        if request.reformulated:
            assert request.question != QUESTIONS[request.need]
            assert str(request.need) in request.question  # the need's keywords survive
        else:
            assert request.question == QUESTIONS[request.need]
        seen.add(request.need)
    assert not any(r.reformulated for r in generate_trace(QUESTIONS, 50, seed=1, reformulate=0.0))


def test_stats_classify_each_request_against_earlier_ones():
    lists = [[1, 2], [1, 2], [2, 1], [2, 3], [4, 5]]
    stats = trace_stats([TraceRequest("q")] * 5, lists)
    assert (stats.same_order, stats.other_order, stats.partly, stats.fresh) == (0.2, 0.2, 0.2, 0.4)
    assert stats.seen_before == pytest.approx((0 + 2 + 2 + 1 + 0) / 10)
    assert stats.distinct_chunks == 5


def test_trace_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, [TraceRequest("Who built it?", 4), TraceRequest("When?")])
    assert [(r.question, r.top_k) for r in read_trace(path)] == [
        ("Who built it?", 4),
        ("When?", None),
    ]
    path.write_text('{"question": "ok"}\n{"question": "bad", "top_k": 0}\n')
    with pytest.raises(InvalidRequest, match=":2: top_k"):
        read_trace(path)
    path.write_text('{"question": "ok"}\nnot json\n')
    with pytest.raises(InvalidRequest, match=":2: not JSON"):
        read_trace(path)
    path.write_text("\n")
    with pytest.raises(InvalidRequest, match="no requests"):
        read_trace(path)
