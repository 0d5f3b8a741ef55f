"""The Cache-Craft formulas against hand-computed values."""

from __future__ import annotations

import math

import pytest

from engine.cachecraft.scores import (
    beta,
    beta_prime,
    cci,
    cfo,
    gamma,
    inter_intra_terms,
    novelty_coverage,
    recompute_count,
    top_token_offsets,
)


def test_cci_is_the_logistic_of_a_over_b():
    assert cci(0.0, 0.2) == 0.5
    assert cci(0.1, 0.2) == pytest.approx(1 / (1 + math.exp(-0.5)))
    assert cci(0.3, 0.0) == 1.0


def test_a_and_b_normalise_by_sizes():
    a, b = inter_intra_terms({"x": 8.0, "y": 2.0}, {"x": 4, "y": 10}, intra=50.0, num_tokens=10)
    assert a == pytest.approx(8.0 / (10 * 4) + 2.0 / (10 * 10))
    assert b == pytest.approx(50.0 / 100)


def test_beta_is_the_share_of_inter_attention_still_present():
    inter = {"a": 3.0, "b": 1.0, "c": 4.0}
    assert beta(inter, ["a", "b", "c"], ["c", "a"]) == pytest.approx(7.0 / 8.0)
    assert beta(inter, ["a", "b", "c"], ["z"]) == 0.0
    assert beta({}, [], []) == 1.0  # both empty: identical
    assert beta({}, [], ["a"]) == 0.0


def test_gamma_counts_discordant_pairs():
    assert gamma(["a", "b", "c"], ["a", "b", "c"]) == 0.0
    assert gamma(["a", "b", "c"], ["c", "b", "a"]) == 1.0  # reversed
    assert gamma(["a", "b", "c"], ["b", "a", "c"]) == pytest.approx(1 / 3)
    assert gamma(["a", "b"], ["x", "b"]) == 0.0  # fewer than two shared


def test_beta_prime_and_cfo():
    inter = {"a": 1.0, "b": 1.0}
    bp = beta_prime(inter, ["a", "b"], ["b", "a"])  # beta 1, gamma 1
    assert bp == 0.0
    assert cfo(2.0, 0.75, bp) == 1.0  # clamped
    assert cfo(0.5, 0.8, 0.25) == pytest.approx(0.5 * 0.8 * 0.75)
    assert cfo(1.0, 0.8, 1.0) == 0.0


def test_identical_context_gives_cfo_zero():
    inter = {"a": 2.0, "b": 1.0}
    assert (
        cfo(
            1.0,
            0.9,
            beta_prime(inter, ["a", "b"], ["a", "b"]),
            novelty_coverage(["a", "b"], ["a", "b"]),
        )
        == 0.0
    )


def test_novelty_coverage_counts_new_neighbours_the_variant_saw():
    assert novelty_coverage(["c"], ["a", "b", "c"]) == pytest.approx(1 / 3)
    assert novelty_coverage(["a", "b", "c"], ["a"]) == 1.0
    assert novelty_coverage([], []) == 1.0
    # a variant computed after c only scores beta' = 1, but covers a third of the new context
    assert cfo(1.0, 0.9, beta_prime({"c": 1.0}, ["c"], ["a", "b", "c"]), 1 / 3) == pytest.approx(
        0.9 * 2 / 3
    )


def test_recompute_count_is_the_ceiling():
    assert recompute_count(0.1, 25) == 3
    assert recompute_count(0.0, 25) == 0
    assert recompute_count(1.0, 25) == 25


def test_token_choice_picks_the_highest_scores_in_order():
    offsets = top_token_offsets([0.1, 0.9, 0.3, 0.9, 0.5], 3)
    assert offsets.tolist() == [1, 3, 4]
    assert top_token_offsets([0.2, 0.2, 0.2], 2).tolist() == [0, 1]  # ties: earlier tokens
    assert top_token_offsets([1.0], 0).numel() == 0
