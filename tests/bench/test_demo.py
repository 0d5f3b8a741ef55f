"""`kvmosaic bench demo`'s scoring: exact golds, wrong questions named, the lighthouse shown."""

from __future__ import annotations

from bench.demo import EXACT_GOLDS, LIGHTHOUSE, PassResult, format_demo


def test_a_year_alone_is_not_the_lighthouse_s_exact_gold():
    first_two = list(EXACT_GOLDS)[:2]
    answers = {LIGHTHOUSE: "It was first lit in 1811.", first_two[1]: "Robert Skene designed it."}
    result = PassResult("cachecraft", "cold", answers, {q: "exact-first" for q in answers})
    assert result.wrong == [1] and result.right == 1
    table = format_demo([result])
    assert "cachecraft   cold    1/2  1" in table and "exact-first 2" in table


def test_the_day_month_and_year_together_count():
    answers = {LIGHTHOUSE: "On 3 November 1811."}
    result = PassResult("full", "warm", answers, {LIGHTHOUSE: "exact"})
    assert result.right == 1 and result.wrong == []
