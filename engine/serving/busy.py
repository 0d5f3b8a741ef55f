"""Blend or not: a balanced request skips its blend when, by the recent odds, the blend would
only add to what it costs.

Under `balanced` (engine/serving/guard.py) a blended first attempt ends in a full prefill whenever
the guard re-runs it at the first token (inside TTFT) or repairs its decode (after it). Such a
request pays its blend and then the reference prefill anyway. Skipping the blend computes at
once what it would be repaired to: every row after its exact leading chunks, as `prefix` does
(exact over float KV, so nothing is checked or repaired, and its chunks are kept as exact
variants, as a repair's are).

`RepairOdds` keeps the outcomes of recent blended balanced requests: kept, re-run at the first
token, or repaired while decoding. Blending costs a blend b of the rows after the exact lead
plus, with odds p, all of them again; skipping costs them once: the skip saves when p >= 1 - b
(`EngineConfig.guard_busy_repair_share`, None: never skip). Which odds count depends on what is
scarce. Idle, a request's own TTFT: only first-token re-runs land inside it, so p is their
share. Busy (another request's prefill or repair in flight, or another request decoding), the
cores every request waits for: repairs cost them too, so p is the share of both.
`BusyGate.skip_blend` applies this; every `EXPLORE_EVERY`-th request that would skip blends
instead, so the odds follow a change in traffic (a blend that now holds). The engine asks only
for a balanced request about to blend; this module computes nothing itself.

What the skip buys and costs: docs/benchmarks/guard.md ("Under load").
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
    """Outcomes of recent blended `balanced` requests: whether each needed a full prefill, and
    whether that was a re-run at its first token. Shares carry a uniform prior (0.5 before any
    outcome). Thread-safe."""

    def __init__(self, window: int = ODDS_WINDOW):
        # (needed a full prefill, at the first token)
        self._outcomes: deque[tuple[bool, bool]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def record(self, needed_full_prefill: bool, at_first_token: bool = False) -> None:
        """One blend's outcome: kept (False), or needed a full prefill (re-run at the first token
        when `at_first_token`, else repaired while decoding)."""
        with self._lock:
            self._outcomes.append((needed_full_prefill, needed_full_prefill and at_first_token))

    @property
    def share(self) -> float:
        """Share of blends that needed a full prefill, re-run or repaired."""
        with self._lock:
            return (sum(full for full, _ in self._outcomes) + 1) / (len(self._outcomes) + 2)

    @property
    def rerun_share(self) -> float:
        """Share of blends re-run at their first token (inside their TTFT)."""
        with self._lock:
            return (sum(first for _, first in self._outcomes) + 1) / (len(self._outcomes) + 2)

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
        `guard_busy_repair_share` (None: never) and the number of other requests `decoding`:
        busy, by the odds of any full prefill; idle, by the odds of a first-token re-run (the
        module docstring). Counts the skip."""
        if repair_share is None:
            return False
        busy = self.others_in_flight() + decoding > 0
        odds = self.odds.share if busy else self.odds.rerun_share
        if odds < repair_share:
            return False
        with self._lock:
            self._would_skip += 1
            if self._would_skip % EXPLORE_EVERY == 0:
                return False
            self.skipped += 1
            return True
