"""The frontier table (#57): every row of a fidelity report with what it gives and what it costs.

One markdown row per report row, `full` first and the floor second: accuracy with its 95%
interval, the paired difference against full, median TTFT against full, the share of context
rows recomputed, tokens computed at ingest and KV bytes kept per chunk token
(bench/fidelity/storage.py). Figures only; which row holds is the reader's rule, written
before the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.fidelity.accuracy import Interval
from bench.fidelity.fidelity import FLOOR, REFERENCE, ModeSummary
from bench.fidelity.storage import format_ingest, format_kib

HEADER = (
    "| row | accuracy [95%] | vs full [95%] | TTFT vs full | recomputed | ingest per token "
    "| KiB kept per token |",
    "|---|---|---|---|---|---|---|",
)


def frontier_table(summaries: Sequence[ModeSummary]) -> str:
    """The report's rows as the frontier table's markdown (see the module docstring)."""
    return "\n".join([*HEADER, *(_row(s) for s in summaries)])


def _row(s: ModeSummary) -> str:
    if s.mode == FLOOR:  # full in another order: what reordering alone does
        cells = [
            "floor (full, other order)",
            _interval(s.accuracy),
            _interval(s.accuracy_vs_full, True),
        ]
        return "| " + " | ".join(cells + [""] * 4) + " |"
    versus = "—" if s.mode == REFERENCE else _interval(s.accuracy_vs_full, signed=True)
    cells = [
        f"`{s.mode}`",
        _interval(s.accuracy),
        versus,
        f"{s.median_ttft_ratio:.2f}×",
        f"{s.recompute_share:.3f}",
        _dash(format_ingest(s.ingest_per_token)).replace("x", "×"),
        _dash(format_kib(s.stored_bytes_per_token)),
    ]
    return "| " + " | ".join(cells) + " |"


def _interval(value: Interval, signed: bool = False) -> str:
    if math.isnan(value.mean):
        return "—"
    sign = "+" if signed else ""
    return f"{value.mean:{sign}.3f} [{value.low:{sign}.3f}, {value.high:{sign}.3f}]"


def _dash(text: str) -> str:
    """A figure the report does not carry reads as an em dash, as in the docs' tables."""
    return "—" if text == "-" else text
