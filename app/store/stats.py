"""Per-tier counters of the tiered store, and the report `TieredStore.stats()` returns."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields
from typing import Literal, TypedDict

import torch

from app.store.base import EntryReader

# What a tier is now (`TierReport.state`).
TierState = Literal["up", "degraded", "down"]


@dataclass
class TierCounters:
    """Monotonic counts since start. A lookup that reaches a tier is a hit or a miss there."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # entries found but refused (checksum, truncation, wrong model ...)
    puts: int = 0
    put_failures: int = 0
    evictions: int = 0  # entries removed to make room (demoted or dropped)
    demotions: int = 0  # evicted entries written to the next tier
    promotions: int = 0  # entries copied up after a hit
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass(frozen=True)
class TierReport:
    """One tier now. `available`: reachable (not skipped as down); `write_error`: why its last
    write failed while it still cannot write (None: it can), which makes it degraded."""

    name: str
    available: bool
    capacity_bytes: int
    used_bytes: int
    num_entries: int
    num_pinned: int
    counters: TierCounters
    write_error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def state(self) -> TierState:
        """ "up", "degraded" (reachable, cannot write) or "down" (unreachable, skipped)."""
        return "down" if not self.available else "degraded" if self.write_error else "up"

    def figures(self) -> TierFigures:
        """The flat figures /admin, /health and /metrics show for this tier."""
        c = self.counters
        return {
            "entries": self.num_entries,
            "bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "hits": c.hits,
            "misses": c.misses,
            "available": self.available,
            "pinned": self.num_pinned,
            "evictions": c.evictions,
            "demotions": c.demotions,
            "promotions": c.promotions,
            "corrupt": c.corrupt,
            "state": self.state,
            "writable": self.available and not self.write_error,
            "write_error": self.write_error,
            "put_failures": c.put_failures,
        }


class TierFigures(TypedDict):
    """One tier's occupancy and counters since start, flat (`TierReport.figures`)."""

    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    available: bool
    pinned: int
    evictions: int
    demotions: int
    promotions: int
    corrupt: int
    state: TierState
    writable: bool
    write_error: str | None
    put_failures: int


class CounterBook:
    """Thread-safe TierCounters per tier name."""

    def __init__(self, names: list[str]):
        self._counters = {n: TierCounters() for n in names}
        self._lock = threading.Lock()

    def add(self, tier: str, **amounts: int) -> None:
        with self._lock:
            counters = self._counters[tier]
            for name, amount in amounts.items():
                setattr(counters, name, getattr(counters, name) + amount)

    def snapshot(self, tier: str) -> TierCounters:
        with self._lock:
            c = self._counters[tier]
            return TierCounters(**{f.name: getattr(c, f.name) for f in fields(c)})


class CountedReader(EntryReader):
    """Wraps a tier's reader so that every layer read adds to the tier's `bytes_read`."""

    def __init__(self, inner: EntryReader, book: CounterBook, tier: str):
        self.meta, self._inner, self._book, self._tier = inner.meta, inner, book, tier

    def layer(self, index: int) -> torch.Tensor:
        tensor = self._inner.layer(index)
        self._book.add(self._tier, bytes_read=tensor.numel() * tensor.element_size())
        return tensor

    def close(self) -> None:
        self._inner.close()
