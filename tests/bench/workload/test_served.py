"""The workload bench's exact / blended / computed shares, its oracle line, the per-cell chunk
order and the trace of distinct questions."""

from __future__ import annotations

import pytest
import torch

from bench.workload.cell import RequestFacts
from bench.workload.modes import parse_mode
from bench.workload.served import oracle_work, served_shares
from bench.workload.trace import distinct_trace
from engine.errors import InvalidRequest


def facts(served: tuple[int, int, int]) -> RequestFacts:
    return RequestFacts(0, (1,), "", 1, torch.zeros(2), 0.1, 0.1, 0.2, 0.0, 0, served=served)


def test_served_shares_weigh_tokens_over_the_cell():
    shares = served_shares([facts((30, 0, 10)), facts((0, 40, 20))])
    assert shares == pytest.approx({"exact": 0.3, "blended": 0.4, "computed": 0.3})
    assert served_shares([]) == {}


def test_the_oracle_computes_first_sightings_off_the_head_and_questions():
    tokens = {1: 10, 2: 20, 3: 30, 4: 5}
    oracle = oracle_work([[1, 2], [2, 1], [3, 1, 4]], tokens, [7, 7, 7])
    # request 1: 1 and 2 are new, 2 (the longer) goes first from its base: 10 computed;
    # request 2: both seen; request 3: 3 and 4 new, 3 first: 5 computed
    assert (oracle.context_tokens, oracle.first_sightings, oracle.question_tokens) == (105, 15, 21)
    assert oracle.exact_share == pytest.approx(1 - 15 / 105)
    assert oracle.rows_vs_full == pytest.approx((15 + 21) / (105 + 21))
    assert "oracle" in oracle.line() and "86%" in oracle.line()


def test_a_repeated_list_is_all_exact_for_the_oracle():
    oracle = oracle_work([[1], [1], [1]], {1: 8}, [0, 0, 0])
    assert oracle.first_sightings == 0 and oracle.exact_share == 1.0


def test_a_cell_can_name_its_chunk_order():
    spec = parse_mode("prefix:order=cache-aware")
    assert spec.mode == "prefix" and spec.overrides() == {"chunk_order": "cache-aware"}
    assert spec.name == "prefix:order=cache-aware"


def test_a_trace_of_distinct_questions_asks_each_once():
    questions = [f"q{i}" for i in range(10)] + ["q3"]
    trace = distinct_trace(questions, 8, seed=2)
    assert len({r.question for r in trace}) == 8 and not any(r.reformulated for r in trace)
    assert (
        distinct_trace(questions, 8, seed=2) == trace
        and distinct_trace(questions, 8, seed=3) != trace
    )
    with pytest.raises(InvalidRequest, match="10"):
        distinct_trace(questions, 11)
