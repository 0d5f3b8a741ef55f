"""The one contract every KV tier honours (`BaseTier`), with its edge cases.

A tier maps keys (lowercase hex digests, 16–64 characters; file names and Redis keys are
built from them and nothing else) to `KVEntry`s. Tiers only store: choosing what to evict,
promoting and demoting is the `TieredStore`'s job, and capacities are advisory here (a tier
never refuses a put for lack of room; the manager makes room first).

Byte accounting: every tier counts the payload bytes of its entries (`KVEntry.num_bytes`;
headers are not counted), so sizes agree across tiers and `used_bytes()` equals the sum of
`keys().values()` at every quiet moment.
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import torch

from app.store.config import StoreConfig
from app.store.entry import EntryMeta, KVEntry
from engine.errors import KvMosaicError

_KEY = re.compile(r"^[0-9a-f]{16,64}$")


class TierUnavailable(KvMosaicError):
    """The tier cannot serve now (no CUDA, Redis unreachable); callers skip it."""


class EntryPinned(KvMosaicError):
    """Removal of an entry that is pinned (in use by a request)."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"store keys are lowercase hex digests of 16-64 characters, got {key!r}")
    return key


@dataclass(frozen=True)
class TierOccupancy:
    """How full one tier is, a snapshot (`BaseTier.stats()`); bytes are payload bytes.

    Not the API's `app.schemas.admin.TierStats`: that one is what `/admin/stats` serves of
    the store's `TierReport` (this snapshot plus the tier's counters)."""

    name: str
    capacity_bytes: int
    used_bytes: int
    num_entries: int
    num_pinned: int


class EntryReader(ABC):
    """One entry opened for reading layer by layer; use as a context manager or close().

    `meta` is validated on open. `layer(i)` returns layer i, [2, kv_heads, tokens,
    head_dim] in the storage dtype, checksum-verified; it raises `CorruptEntry` if the bytes
    are bad or vanished, and may be called from any thread, in any order, more than once.
    The reader sees the entry as it was when opened, even if it is replaced or removed
    meanwhile (where the tier can guarantee it; Redis cannot, and then raises CorruptEntry).
    """

    meta: EntryMeta

    @abstractmethod
    def layer(self, index: int) -> torch.Tensor: ...

    def close(self) -> None:  # noqa: B027 (a hook: does nothing unless overridden)
        """Release handles; further layer() calls are not allowed. Idempotent."""

    def __enter__(self) -> EntryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BaseTier(ABC):
    """A store tier. Thread-safe: every method may be called from any thread at any time.

    Edge cases, the same for every tier:
    - put(key, entry) replaces any entry under key; readers see the old or the new entry,
      never a mix. It raises TierUnavailable if the backend is down, OSError if its medium
      refuses the write (no space, read-only, I/O error); either way nothing changes.
    - get / open / get_layer of an absent key return None; of a present entry that fails
      validation raise CorruptEntry (the caller decides to remove it). They never return
      unverified bytes.
    - remove(key) of an absent key returns False; of a pinned key raises EntryPinned.
      discard(key) is remove without the pin check (for the TieredStore only).
    - pin / unpin count references per key and may be called for an absent key (the pin
      protects the key if it appears later); unpin below zero raises ValueError.
    - close() is idempotent; afterwards the tier must not be used.
    """

    name: ClassVar[str]
    # True when other server replicas read and write the same entries (Redis): only then may
    # one replica conclude from this tier that a shared catalog's variant is gone.
    shared: ClassVar[bool] = False

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = int(capacity_bytes)
        self._pins: Counter[str] = Counter()
        self._pin_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: StoreConfig, check: bool = True) -> BaseTier:
        """Build the tier from a StoreConfig; raise TierUnavailable if it cannot run here.

        `check` False skips probing a remote backend (its first operation fails instead)."""
        raise NotImplementedError(f"tier {cls.name} cannot be built from a StoreConfig")

    # -- storage (per tier) --------------------------------------------------------------------

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def put(self, key: str, entry: KVEntry) -> None: ...

    @abstractmethod
    def get(self, key: str) -> KVEntry | None: ...

    @abstractmethod
    def open(self, key: str) -> EntryReader | None: ...

    @abstractmethod
    def discard(self, key: str) -> bool:
        """Delete the entry whether pinned or not; True if it existed, False if absent.

        For the `TieredStore`, which keeps pins across all tiers itself and must drop a
        corrupt entry even while a request holds it; everyone else calls `remove`, which
        refuses a pinned key. `key` must be valid (`check_key`): not every tier checks it
        again. Readers already open keep their view (see `EntryReader`). Raises
        TierUnavailable if the backend is down.
        """

    @abstractmethod
    def keys(self) -> dict[str, int]:
        """{key: payload bytes} of every entry, a snapshot."""

    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def close(self) -> None: ...

    def check_writable(self) -> None:  # noqa: B027 (a hook: does nothing unless overridden)
        """Raise OSError if the tier cannot take a write now (a full or read-only disk).

        The `TieredStore` asks this of a tier whose put failed, to learn when it can write
        again without risking an entry. Tiers with no local medium have nothing to check."""

    # -- shared behaviour ----------------------------------------------------------------------

    def get_layer(self, key: str, index: int) -> torch.Tensor | None:
        """Layer `index` of the entry alone (None if absent); CorruptEntry if bad."""
        reader = self.open(key)
        if reader is None:
            return None
        with reader:
            if not 0 <= index < reader.meta.num_layers:
                raise IndexError(f"layer {index} out of range for {reader.meta.num_layers} layers")
            return reader.layer(index).clone()

    def remove(self, key: str) -> bool:
        """Delete the entry unless pinned (EntryPinned); True if it existed."""
        check_key(key)
        if self.is_pinned(key):
            raise EntryPinned(f"entry {key} is pinned in tier {self.name}")
        return self.discard(key)

    def pin(self, key: str) -> None:
        with self._pin_lock:
            self._pins[check_key(key)] += 1

    def unpin(self, key: str) -> None:
        with self._pin_lock:
            if self._pins[key] <= 0:
                raise ValueError(f"unpin of {key} in tier {self.name} without a matching pin")
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]

    def is_pinned(self, key: str) -> bool:
        with self._pin_lock:
            return self._pins.get(key, 0) > 0

    def stats(self) -> TierOccupancy:
        """Capacity, bytes used, entries held and how many of them are pinned, now."""
        keys = self.keys()
        with self._pin_lock:
            pinned = sum(1 for k in self._pins if k in keys)
        return TierOccupancy(self.name, self.capacity_bytes, self.used_bytes(), len(keys), pinned)
