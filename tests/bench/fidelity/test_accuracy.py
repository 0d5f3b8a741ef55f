"""Task accuracy scoring, bootstrap intervals and the answerable case generator."""

from __future__ import annotations

import math

import pytest

from bench.fidelity.accuracy import bootstrap, paired_difference, per_case_means, score_answer
from bench.fidelity.cases import KINDS, generate_cases
from bench.fidelity.fidelity import chunk_orders
from engine.errors import InvalidRequest


def test_containment_is_normalised_and_on_word_boundaries():
    assert score_answer("It was founded in 1764 by Odalys.", ["1764"]).contains == 1.0
    assert score_answer("In 17640.", ["1764"]).contains == 0.0
    assert score_answer("the Lousk", ["Lousk"]).exact == 1.0  # articles and case do not count
    assert score_answer("Lousk river", ["Lousk"]).exact == 0.0
    assert score_answer("Lousk river", ["Lousk"]).f1 == pytest.approx(2 / 3)
    assert math.isnan(score_answer("anything", []).contains)


def test_bootstrap_is_seeded_and_brackets_the_mean():
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    interval = bootstrap(values, seed=3)
    assert interval == bootstrap(values, seed=3)
    assert interval.low < interval.mean < interval.high and interval.mean == pytest.approx(0.625)
    assert bootstrap([1.0] * 5).half_width == 0.0
    assert math.isnan(bootstrap([float("nan")]).mean)
    # more cases, narrower interval
    assert bootstrap(values * 10, seed=3).half_width < interval.half_width


def test_paired_difference_cancels_what_both_share():
    mode, full = [1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]
    diff = paired_difference(mode, full)
    assert diff.mean == pytest.approx(0.25) and diff.low >= 0.0
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference([1.0], [1.0, 0.0])
    assert per_case_means([1.0, 0.0, 1.0, 1.0], [7, 7, 9, 9]) == [0.5, 1.0]


def test_cases_are_reproducible_distinct_across_seeds_and_answerable():
    cases = generate_cases(seed=1, n=9)
    assert cases == generate_cases(seed=1, n=9)
    assert {c["question"] for c in cases}.isdisjoint(
        c["question"] for c in generate_cases(seed=2, n=9)
    )
    assert [c["kind"] for c in cases] == list(KINDS) * 3
    for case in cases:
        assert len(case["ctxs"]) == 6
        gold = case["answers"][0]
        assert any(gold in ctx["text"] for ctx in case["ctxs"]), case


def test_a_comparison_names_the_place_with_the_earlier_stated_year():
    for case in generate_cases(seed=5, n=12, kinds=("compare",)):
        names = (
            case["question"]
            .removeprefix("Which town was founded earlier, ")
            .rstrip("?")
            .split(" or ")
        )
        years = {}
        for ctx in case["ctxs"]:
            if ctx["title"] in names:
                years[ctx["title"]] = int(ctx["text"].split("founded in ")[1][:4])
        assert case["answers"] == [min(years, key=years.get)]


def test_twohop_states_the_bridge_in_the_founders_own_passage():
    for case in generate_cases(seed=4, n=6, kinds=("twohop",)):
        founder = next(c for c in case["ctxs"] if " was born in " in c["text"])
        assert case["answers"][0] in founder["text"]
        place = (
            case["question"]
            .removeprefix("In which town was the founder of ")
            .removesuffix(" born?")
        )
        assert founder["title"] in next(c["text"] for c in case["ctxs"] if c["title"] == place)


def test_bad_generator_arguments_and_orders_are_refused():
    with pytest.raises(ValueError, match="at least 2 passages"):
        generate_cases(seed=0, n=1, chunks=1)
    with pytest.raises(ValueError, match="unknown case kinds"):
        generate_cases(seed=0, n=1, kinds=("riddle",))
    orders = chunk_orders([1, 2, 3, 4], 3, seed=0)
    assert orders[0] == [1, 2, 3, 4] and all(
        sorted(o) == [1, 2, 3, 4] and o != orders[0] for o in orders[1:]
    )
    with pytest.raises(InvalidRequest, match="at least one chunk order"):
        chunk_orders([1, 2], 0, seed=0)
