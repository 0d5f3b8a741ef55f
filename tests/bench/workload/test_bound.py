"""The throughput bound: a line fitted to the cells' CPU per request against their work, read
at the oracle's rows."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest

from bench.workload.bound import throughput_bounds
from bench.workload.served import OracleWork
from bench.workload.summary import CellSummary

# 26 of 100 rows computed: rows_vs_full 0.26
ORACLE = OracleWork(context_tokens=90, first_sightings=16, question_tokens=10)


def cell(load: str, work: float | None, cpu: float, requests: int = 8) -> CellSummary:
    """A summary with only what the bound reads; every other field zero, None or empty."""
    empty: dict[str, Any] = {}
    for f in dataclasses.fields(CellSummary):
        kind = str(f.type)
        blank: Any = {} if "dict" in kind else [] if "list" in kind else 0
        empty[f.name] = None if "None" in kind else blank
    return cast(
        CellSummary,
        CellSummary(
            **{
                **empty,
                "mode": "m",
                "load": load,
                "requests": requests,
                "work_vs_full": work,
                "cpu_s_per_request": cpu,
            }
        ),
    )


def test_cells_on_a_line_give_its_overhead_prefill_cost_and_bound():
    # CPU s/request = 2 + 6 x work, exactly
    cells = [cell("c=4", w, 2 + 6 * w) for w in (1.0, 0.5, 0.2)]
    (bound,) = throughput_bounds(cells, ORACLE)
    assert bound.overhead_s == pytest.approx(2.0)
    assert bound.prefill_s == pytest.approx(6.0)
    assert bound.max_residual_s == pytest.approx(0.0, abs=1e-9)
    assert bound.ratio == pytest.approx(8.0 / (2 + 6 * 0.26))
    assert "at most 2.25x full's req/s" in bound.line()


def test_each_load_gets_its_own_fit_and_a_noisy_cell_shows_as_a_miss():
    cells = [cell("c=1", w, 1 + 4 * w) for w in (1.0, 0.6, 0.3)]
    cells += [cell("c=4", 1.0, 8.0), cell("c=4", 0.5, 5.5), cell("c=4", 0.2, 3.2)]
    bounds = throughput_bounds(cells, ORACLE)
    assert [b.load for b in bounds] == ["c=1", "c=4"]
    assert bounds[1].max_residual_s > 0.1
    assert bounds[0].ratio > bounds[1].ratio  # less overhead: reuse can buy more


def test_no_bound_without_enough_cells_spread_or_oracle():
    assert throughput_bounds([cell("c=4", 1.0, 8.0), cell("c=4", 0.5, 5.0)], ORACLE) == []
    narrow = [cell("c=4", w, 2 + 6 * w) for w in (1.0, 0.9, 0.8)]
    assert throughput_bounds(narrow, ORACLE) == []
    spread = [cell("c=4", w, 2 + 6 * w) for w in (1.0, 0.5, 0.2)]
    assert throughput_bounds(spread, None) == []
    unmeasured = [cell("c=4", None, 3.0), *spread[:2], cell("c=4", 0.2, 4.0, requests=0)]
    assert throughput_bounds(unmeasured, ORACLE) == []
    # more work costing less CPU is no prefill cost: no bound
    inverted = [cell("c=4", w, 8 - 6 * w) for w in (1.0, 0.5, 0.2)]
    assert throughput_bounds(inverted, ORACLE) == []
