"""Base KV that should be persistent but is held in memory only, until a persistent tier takes it.

Ingest stores base KV in the first persistent tier (disk, else Redis) so it survives a
restart. When that tier cannot write (a full disk: the store marks it degraded) the KV goes
to a memory tier instead, and `Unpersisted` remembers its store key. `retry` copies those
entries into the persistent tier once it can write again: after the next successful
persistent put, and from the replica daemon's periodic job. An entry evicted from memory
meanwhile is forgotten here (the catalog marks it missing; its first use computes it into
the persistent tier). A restart loses the memory copies the same way. So KV is never held in
memory only forever without anyone knowing: the ingest response says so (`kv_memory_only`),
and the degraded tier shows in /readyz, /admin/stats and /metrics.
"""

from __future__ import annotations

import logging
import threading

from app.store import TieredStore

log = logging.getLogger(__name__)


class Unpersisted:
    """Thread-safe set of store keys waiting for `tier` (None: the store has no persistent tier)."""

    def __init__(self, store: TieredStore, tier: str | None):
        self.store = store
        self.tier = tier
        self._keys: set[str] = set()
        self._lock = threading.Lock()
        self._retrying = threading.Lock()  # one retry at a time (ingest threads, the daemon)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def add(self, key: str) -> None:
        """Remember that `key`'s KV is in memory only (no-op without a persistent tier)."""
        if self.tier is not None:
            with self._lock:
                self._keys.add(key)

    def retry(self) -> int:
        """Ask degraded tiers whether they can write again (`TieredStore.recheck_writes`),
        then copy waiting entries into the persistent tier; stops at the first entry it cannot
        take (the tier is still full) and keeps the rest. Returns how many were copied."""
        if self.tier is None or not self._retrying.acquire(blocking=False):
            return 0
        try:
            self.store.recheck_writes()
            copied = 0
            for key in self._snapshot():
                outcome = self.store.persist(key, self.tier)
                if outcome is None:
                    break
                copied += int(outcome)
                with self._lock:
                    self._keys.discard(key)
            if copied:
                log.warning("copied %d memory-only base KV entries into tier %s", copied, self.tier)
            return copied
        finally:
            self._retrying.release()

    def _snapshot(self) -> list[str]:
        with self._lock:
            return sorted(self._keys)
