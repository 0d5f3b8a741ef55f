"""Recent traffic: how often a request's chunk set was retrieved before, within a window.

Building a chunk's exact variant in a new context costs about one more prefill of the
prompt, and repays only when that context comes back. The best predictor at hand is the
past: a chunk set that recurred in the last `window` requests (in any order; the variants of
one order serve other orders of the same set at a CFO set by their discordance) is likely to
recur again, a set seen once rarely is (in MuSiQue, fewer than 1 in 20 requests share five
or more passages with another).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable

from engine.kv import ChunkId


class RecentTraffic:
    """Thread-safe counts of chunk sets over the last `window` requests."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError("the traffic window must hold at least one request")
        self.window = window
        self._recent: deque[frozenset[ChunkId]] = deque()
        self._counts: Counter[frozenset[ChunkId]] = Counter()
        self._lock = threading.Lock()

    def observe(self, chunk_ids: Iterable[ChunkId]) -> int:
        """Record one request's chunks; returns how many earlier requests in the window had
        the same set."""
        key = frozenset(chunk_ids)
        with self._lock:
            earlier = self._counts[key]
            self._recent.append(key)
            self._counts[key] += 1
            if len(self._recent) > self.window:
                old = self._recent.popleft()
                self._counts[old] -= 1
                if not self._counts[old]:
                    del self._counts[old]
            return earlier

    def seen(self, chunk_ids: Iterable[ChunkId]) -> int:
        """How many requests in the window had this chunk set (the one asking included, if
        it was observed)."""
        with self._lock:
            return self._counts[frozenset(chunk_ids)]
