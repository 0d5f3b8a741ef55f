"""Model work done by a process: every layer-row a prefill-style run computed, counted as it
happens.

The layer runner adds each run's per-row layer counts here (request prefills, base KV computed
at ingest or on a miss, Cache-Craft variant builds in the background, statistics passes), so a
benchmark can charge all of it to the requests that caused it, not only the foreground prefill.
Decode steps are not counted: they are one row per token in every mode.

Work done on a thread marked with `mark_background_thread()` (the variant builder) is also
added to a separate background total, so a benchmark can say how much ran off the request path.

Two counts are kept, enough to turn into FLOPs later (`bench.fidelity.flops.FlopCounter.of_work`):
`layer_rows`, the number of (row, layer) pairs that ran attention + MLP, and `key_rows`, the
same pairs weighted by the keys each row attended over (position + 1).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorkTotals:
    """Cumulative work since the meter was made; subtract two snapshots for an interval."""

    runs: int = 0
    layer_rows: int = 0
    key_rows: int = 0

    def __add__(self, other: WorkTotals) -> WorkTotals:
        return WorkTotals(
            self.runs + other.runs,
            self.layer_rows + other.layer_rows,
            self.key_rows + other.key_rows,
        )

    def __sub__(self, other: WorkTotals) -> WorkTotals:
        return WorkTotals(
            self.runs - other.runs,
            self.layer_rows - other.layer_rows,
            self.key_rows - other.key_rows,
        )


def work_of(layers_computed: torch.Tensor) -> WorkTotals:
    """The work of one run in which row p ran `layers_computed[p]` layers."""
    layers = layers_computed.detach().to("cpu", torch.long)
    keys = torch.arange(1, layers.numel() + 1, dtype=torch.long)  # row p sees p + 1 keys
    return WorkTotals(1, int(layers.sum()), int((layers * keys).sum()))


_thread = threading.local()


def mark_background_thread() -> None:
    """Count the work this thread does from now on as background work (see the module docstring)."""
    _thread.background = True


def is_background_thread() -> bool:
    """Whether this thread's work counts as background work."""
    return bool(getattr(_thread, "background", False))


@contextmanager
def counted_as(background: bool) -> Iterator[None]:
    """Count this thread's work as background (or not) while inside: work that one thread runs
    for another (the engine's compute thread) is charged as the requesting thread's would be."""
    before = is_background_thread()
    _thread.background = background
    try:
        yield
    finally:
        _thread.background = before


class WorkMeter:
    """Thread-safe running totals of model work (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = WorkTotals()
        self._background = WorkTotals()

    def add(self, layers_computed: torch.Tensor) -> None:
        """Count one run in which row p ran `layers_computed[p]` layers."""
        run = work_of(layers_computed)
        background = is_background_thread()
        with self._lock:
            self._totals = self._totals + run
            if background:
                self._background = self._background + run

    def snapshot(self) -> WorkTotals:
        """All work so far."""
        with self._lock:
            return self._totals

    def background_snapshot(self) -> WorkTotals:
        """The part of `snapshot()` done on background threads."""
        with self._lock:
            return self._background
