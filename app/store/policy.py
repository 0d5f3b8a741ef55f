"""Eviction policies: which unpinned entry of a full tier goes first.

Each policy ranks candidates by a sort key; the smallest key is evicted first.
- `lru`: least recently used first.
- `lfu`: least frequently used first, ties broken by recency.
- `value`: lowest expected savings x access frequency / size first (Cache-Craft §eviction):
  `savings` is the prefill work (in tokens) one use of the entry saves — the chunk's token
  count by default, a better estimate (e.g. (1 - CFO) x tokens) when the catalog has one;
  frequency is uses + 1, so a fresh entry is not worthless before its first hit.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

# A policy's sort key for one candidate; tuples compare element by element.
Rank = tuple[float | str, ...]


@dataclass
class Usage:
    """What the store knows of a key's use. `last_access` is a logical clock (higher = later)."""

    last_access: int = 0
    access_count: int = 0
    savings: float | None = None
    num_tokens: int | None = None


@dataclass(frozen=True)
class EvictionCandidate:
    """An unpinned entry of a full tier that may be evicted: its key, payload bytes and usage."""

    key: str
    size: int
    usage: Usage


class BaseEvictionPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def rank(self, candidate: EvictionCandidate) -> Rank:
        """Sort key; the candidate with the smallest rank is evicted first."""

    def victim(self, candidates: list[EvictionCandidate]) -> EvictionCandidate | None:
        """The candidate to evict first; None if there are none (evicting nothing is safe)."""
        return min(candidates, key=self.rank, default=None)


class LruPolicy(BaseEvictionPolicy):
    name = "lru"

    def rank(self, candidate: EvictionCandidate) -> Rank:
        return (candidate.usage.last_access, candidate.key)


class LfuPolicy(BaseEvictionPolicy):
    name = "lfu"

    def rank(self, candidate: EvictionCandidate) -> Rank:
        return (candidate.usage.access_count, candidate.usage.last_access, candidate.key)


class ValuePolicy(BaseEvictionPolicy):
    name = "value"

    def rank(self, candidate: EvictionCandidate) -> Rank:
        return (value_density(candidate), candidate.usage.last_access, candidate.key)


def value_density(candidate: EvictionCandidate) -> float:
    """Expected savings x (uses + 1) / bytes."""
    usage = candidate.usage
    savings = usage.savings if usage.savings is not None else float(usage.num_tokens or 1)
    return max(savings, 0.0) * (usage.access_count + 1) / max(candidate.size, 1)


POLICIES: dict[str, type[BaseEvictionPolicy]] = {
    p.name: p for p in (LruPolicy, LfuPolicy, ValuePolicy)
}


def create_policy(name: str) -> BaseEvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}")
    return POLICIES[name]()


class UsageBook:
    """Thread-safe `Usage` per key, with a logical clock for recency."""

    def __init__(self) -> None:
        self._usage: dict[str, Usage] = {}
        self._clock = itertools.count(1)
        self._lock = threading.Lock()

    def get(self, key: str) -> Usage:
        """A copy of what is known of `key` (a blank Usage if nothing)."""
        with self._lock:
            found = self._usage.get(key)
            return Usage(**vars(found)) if found else Usage()

    def used(self, key: str, num_tokens: int, hit: bool) -> None:
        """`key` was just stored (hit False) or served (hit True)."""
        with self._lock:
            usage = self._usage.setdefault(key, Usage())
            usage.last_access, usage.num_tokens = next(self._clock), num_tokens
            usage.access_count += int(hit)

    def seed(self, key: str, access_count: int | None = None, savings: float | None = None) -> None:
        with self._lock:
            usage = self._usage.setdefault(key, Usage())
            if access_count is not None:
                usage.access_count = int(access_count)
            if savings is not None:
                usage.savings = float(savings)

    def forget(self, key: str) -> None:
        with self._lock:
            self._usage.pop(key, None)
