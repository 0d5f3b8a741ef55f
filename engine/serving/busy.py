"""Blend or not, under load: a balanced request skips its blend when the blend would only add work.

Under `balanced` (engine/serving/guard.py) a blended first attempt ends in a full prefill whenever
the
guard re-runs it at the first token or repairs its decode; on a small model that is almost
every blended request. Such a request pays its blend and then the reference prefill anyway.
When the engine is idle, the blend still buys its TTFT. When other requests wait for the same
cores, the blend's work delays them all and its own first token waits in line anyway; the
request then does better to compute what it would be repaired to at once: every row after its
exact leading chunks, as `prefix` does (exact over float KV, so nothing is checked or repaired,
and its chunks are kept as exact variants, as a repair's are).

`RepairOdds` keeps the share of recent blended balanced requests that needed a full prefill;
`BusyGate.skip_blend` says to skip when another request is being served (its prefill or
repair in flight, or it is decoding) and that share is at least `guard_busy_repair_share`
(None: never). Skipping costs the reference prefill from the exact prefix; blending costs a
blend b plus, with odds p, that prefill: the skip saves work when p >= 1 - b
(`EngineConfig.guard_busy_repair_share`). Every `EXPLORE_EVERY`-th request that would skip
blends instead, so the odds keep learning under sustained load. The engine asks only for a
balanced request about to blend; this module computes nothing itself.

What the skip buys and costs, with and without load: docs/benchmarks/guard.md ("Under load").
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

# Under load, one in this many requests that would skip their blend blends anyway, so that the
# odds follow a change in traffic (a blend that now holds) without waiting for an idle spell.
EXPLORE_EVERY = 8
# Outcomes the odds remember.
ODDS_WINDOW = 64


class RepairOdds:
    """The share of recent blended `balanced` requests whose answer needed a full prefill
    (re-run at the first token or repaired while decoding), with a uniform prior: 0.5 before
    any outcome. Thread-safe."""

    def __init__(self, window: int = ODDS_WINDOW):
        self._outcomes: deque[bool] = deque(maxlen=window)
        self._lock = threading.Lock()

    def record(self, needed_full_prefill: bool) -> None:
        with self._lock:
            self._outcomes.append(needed_full_prefill)

    @property
    def share(self) -> float:
        with self._lock:
            return (sum(self._outcomes) + 1) / (len(self._outcomes) + 2)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._outcomes)


class BusyGate:
    """Counts the engine's requests whose prefill or repair is in flight and decides, for a
    balanced request about to blend, whether to skip the blend (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self.odds = RepairOdds()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._would_skip = 0
        self.skipped = 0  # blends skipped so far

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        """Hold while a request's prefill or repair is queued or running."""
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def others_in_flight(self) -> int:
        """Prefills and repairs in flight besides the caller's own (call inside `in_flight`)."""
        with self._lock:
            return max(self._in_flight - 1, 0)

    def skip_blend(self, repair_share: float | None, decoding: int = 0) -> bool:
        """Whether the calling request (inside `in_flight`, balanced, about to blend) should
        compute exactly from its exact prefix instead, given the config's
        `guard_busy_repair_share` (None: never) and the number of other requests `decoding`;
        counts the skip."""
        if repair_share is None or self.others_in_flight() + decoding == 0:
            return False
        if self.odds.share < repair_share:
            return False
        with self._lock:
            self._would_skip += 1
            if self._would_skip % EXPLORE_EVERY == 0:
                return False
            self.skipped += 1
            return True
