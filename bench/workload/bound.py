"""The trace's limit in requests per second: what the oracle's work would serve at a load.

The oracle (`bench/workload/served.py`) bounds the prefill rows a request must compute; it does not
say what that buys in throughput, because every request also pays for what no reuse removes
(decoding, retrieval, serving, measuring). Per load, a cell's CPU seconds per request are
fitted over the run's cells as a line in its model work (a share of full's):
cpu = overhead + prefill × work. At the oracle's rows that line is the least CPU a request
costs in this run, and the fitted full cost over it bounds any mode's throughput against
full's where the cores are the limit (every core busy, as at c=4 on a small machine). The
oracle counts rows, and work counts FLOPs, in which a late row (attending to more) weighs more
than an early one; the oracle's computed rows come late, so the bound errs high. It is
an estimate from the run's own cells, printed as one; it needs at least `MIN_CELLS` cells
whose work spans `MIN_SPREAD` of full's, and a positive prefill cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.workload.served import OracleWork
from bench.workload.summary import CellSummary

MIN_CELLS = 3
MIN_SPREAD = 0.3


@dataclass(frozen=True)
class ThroughputBound:
    """At one load: CPU s/request = overhead_s + prefill_s × work (fitted over `cells` cells,
    largest miss `max_residual_s`); `oracle_rows` of full's rows; `ratio`: the fitted full cost
    over the cost at the oracle's rows, the most any mode's req/s can be over full's."""

    load: str
    cells: int
    overhead_s: float
    prefill_s: float
    max_residual_s: float
    oracle_rows: float

    @property
    def ratio(self) -> float:
        full = self.overhead_s + self.prefill_s
        return full / (self.overhead_s + self.prefill_s * self.oracle_rows)

    def line(self) -> str:
        return (
            f"bound @ {self.load}: CPU s/request ~ {self.overhead_s:.2f} + {self.prefill_s:.2f} x "
            f"work (fit over {self.cells} cells, largest miss {self.max_residual_s:.2f} s); at the "
            f"oracle's {self.oracle_rows:.0%} of full's rows a mode serves at most "
            f"{self.ratio:.2f}x full's req/s where the cores are the limit (estimate)"
        )


def throughput_bounds(
    summaries: Sequence[CellSummary], oracle: OracleWork | None
) -> list[ThroughputBound]:
    """One bound per load whose cells allow the fit (module docstring), in load order."""
    if oracle is None:
        return []
    loads = list(dict.fromkeys(s.load for s in summaries))
    bounds = [_bound(load, [s for s in summaries if s.load == load], oracle) for load in loads]
    return [b for b in bounds if b is not None]


def _bound(load: str, cells: Sequence[CellSummary], oracle: OracleWork) -> ThroughputBound | None:
    points = [
        (s.work_vs_full, s.cpu_s_per_request)
        for s in cells
        if s.work_vs_full is not None and s.requests > 0 and s.cpu_s_per_request > 0
    ]
    works = [w for w, _ in points]
    if len(points) < MIN_CELLS or max(works) - min(works) < MIN_SPREAD:
        return None
    overhead, prefill = _line(points)
    if prefill <= 0 or overhead + prefill * oracle.rows_vs_full <= 0:
        return None
    residual = max(abs(cpu - overhead - prefill * w) for w, cpu in points)
    return ThroughputBound(load, len(points), overhead, prefill, residual, oracle.rows_vs_full)


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through `points`."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope
