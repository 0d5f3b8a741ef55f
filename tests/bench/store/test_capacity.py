"""`bench store --capacity`: hit rate of a capped tier under a Zipf trace."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.store.capacity import (
    CapacityOptions,
    format_capacity,
    oracle_hit_rate,
    run_capacity,
    zipf_trace,
)


def test_zipf_trace_is_seeded_and_skewed():
    options = CapacityOptions(entries=50, accesses=2000, seed=3)
    trace = zipf_trace(options)
    assert trace == zipf_trace(options) and len(trace) == 2000
    counts = Counter(trace).most_common()
    assert counts[0][1] > 5 * counts[len(counts) // 2][1]  # rank 1 vs the median entry


def test_oracle_keeps_the_densest_entries():
    assert oracle_hit_rate([0, 0, 0, 1, 2], [10, 10, 10], 10) == pytest.approx(0.6)
    assert oracle_hit_rate([0, 1], [5, 5], 10) == 1.0


def test_capped_tier_hits_less_and_an_uncapped_one_always(tmp_path):
    options = CapacityOptions(
        fractions=(0.25, 1.0),
        policies=("lru", "lfu"),
        entries=40,
        accesses=400,
        min_tokens=8,
        max_tokens=32,
    )
    result = run_capacity(options, tmp_path, log=lambda *_: None)
    assert result.uncapped_hit_rate == 1.0
    cells = {(c.policy, c.fraction): c for c in result.cells}
    for policy in ("lru", "lfu"):
        capped, full = cells[policy, 0.25], cells[policy, 1.0]
        assert full.hit_rate == 1.0 and 0.0 < capped.hit_rate < 1.0
        assert capped.capacity_bytes == int(0.25 * result.corpus_bytes)
        assert capped.hit_rate <= capped.oracle_hit_rate + 0.1
    assert "of uncapped" in format_capacity(result, options)
