"""In-memory tiers: `cpu` (RAM, page-locked when CUDA is present) and `gpu` (CUDA memory).

Entries are held as tensors in the storage dtype; nothing is serialized, so there is no
checksum to verify (memory does not rot the way files do). Returned tensors are the stored
ones: callers must treat them as read-only.
"""

from __future__ import annotations

import threading

import torch

from app.store.base import BaseTier, EntryReader, TierUnavailable, check_key
from app.store.config import StoreConfig
from app.store.entry import KVEntry


class _MemoryReader(EntryReader):
    def __init__(self, entry: KVEntry):
        self.meta = entry.meta
        self._kv = entry.kv  # holding the tensor keeps it alive after a remove

    def layer(self, index: int) -> torch.Tensor:
        return self._kv[index]


class MemoryTier(BaseTier):
    """Entries as tensors on `device`."""

    def __init__(self, capacity_bytes: int, device: torch.device, pin_memory: bool = False):
        super().__init__(capacity_bytes)
        self.device = device
        self.pin_memory = pin_memory
        self._entries: dict[str, KVEntry] = {}
        self._used = 0
        self._lock = threading.Lock()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: str, entry: KVEntry) -> None:
        check_key(key)
        kv = entry.kv.to(self.device).contiguous()
        if kv is entry.kv:  # never alias the caller's tensor: they may reuse it
            kv = kv.clone()
        if self.pin_memory:
            kv = kv.pin_memory()
        stored = KVEntry(entry.meta, kv)
        with self._lock:
            old = self._entries.get(key)
            self._used += stored.num_bytes - (old.num_bytes if old else 0)
            self._entries[key] = stored

    def get(self, key: str) -> KVEntry | None:
        with self._lock:
            return self._entries.get(key)

    def open(self, key: str) -> EntryReader | None:
        entry = self.get(key)
        return _MemoryReader(entry) if entry is not None else None

    def discard(self, key: str) -> bool:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old.num_bytes
            return old is not None

    def keys(self) -> dict[str, int]:
        with self._lock:
            return {k: e.num_bytes for k, e in self._entries.items()}

    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0


class CpuTier(MemoryTier):
    name = "cpu"

    def __init__(self, capacity_bytes: int):
        # Page-locked memory makes CPU -> GPU copies asynchronous; without CUDA it is pointless.
        super().__init__(capacity_bytes, torch.device("cpu"), pin_memory=torch.cuda.is_available())

    @classmethod
    def from_config(cls, config: StoreConfig, check: bool = True) -> CpuTier:
        return cls(config.cpu_bytes)


class GpuTier(MemoryTier):
    name = "gpu"

    def __init__(self, capacity_bytes: int, device: str = "cuda"):
        if not torch.cuda.is_available():
            raise TierUnavailable("the gpu tier needs CUDA, which is not available")
        super().__init__(capacity_bytes, torch.device(device))

    @classmethod
    def from_config(cls, config: StoreConfig, check: bool = True) -> GpuTier:
        return cls(config.gpu_bytes)
