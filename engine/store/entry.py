"""What the store keeps per key: a chunk's KV in the storage dtype plus what identifies it.

A `KVEntry` is the unit every tier stores. Its `EntryMeta` says which model, system prefix
and token ids the KV belongs to, so a reader can refuse an entry that does not match what it
asked for (`EntryExpectation.mismatch`) — such an entry is a miss, never served.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import KvMosaicError
from engine.kv import ChunkKV

STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class CorruptEntry(KvMosaicError):
    """A stored entry failed validation (checksum, size, header); it must not be served."""


def storage_dtype(name: str) -> torch.dtype:
    if name not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage dtype {name!r}; use one of {', '.join(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in STORAGE_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be stored; use one of {', '.join(STORAGE_DTYPES)}")


def token_ids_hash(token_ids: Sequence[int]) -> str:
    """sha256 hex of the token ids as little-endian int64."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class EntryMeta:
    """Identity and shape of a stored KV. shape: [layers, 2, kv_heads, tokens, head_dim]."""

    fingerprint: str
    prefix_digest: str
    token_ids_hash: str
    base_position: int
    dtype: str
    shape: tuple[int, int, int, int, int]
    context: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.shape[3]

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return tuple(self.shape[1:])

    @property
    def torch_dtype(self) -> torch.dtype:
        return storage_dtype(self.dtype)

    @property
    def num_bytes(self) -> int:
        """Payload bytes of the KV (what tier capacities count)."""
        return int(np.prod(self.shape)) * self.torch_dtype.itemsize

    def to_json(self) -> dict:
        return {"fingerprint": self.fingerprint, "prefix_digest": self.prefix_digest,
                "token_ids_hash": self.token_ids_hash, "base_position": self.base_position,
                "dtype": self.dtype, "shape": list(self.shape), "context": list(self.context)}

    @classmethod
    def from_json(cls, data: dict) -> EntryMeta:
        try:
            shape = tuple(int(x) for x in data["shape"])
            if len(shape) != 5 or shape[1] != 2 or min(shape) <= 0:
                raise ValueError(f"bad shape {shape}")
            storage_dtype(data["dtype"])
            return cls(str(data["fingerprint"]), str(data["prefix_digest"]), str(data["token_ids_hash"]),
                       int(data["base_position"]), str(data["dtype"]), shape,
                       tuple(str(c) for c in data.get("context", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptEntry(f"bad entry metadata: {exc}") from exc


@dataclass
class KVEntry:
    """meta plus kv: [layers, 2, kv_heads, tokens, head_dim] in meta.dtype, contiguous."""

    meta: EntryMeta
    kv: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.meta.num_bytes


@dataclass(frozen=True)
class EntryExpectation:
    """What a reader requires of an entry; any difference makes it a miss."""

    fingerprint: str
    prefix_digest: str
    token_ids_hash: str
    dtype: str | None = None
    context: tuple[str, ...] | None = None

    def mismatch(self, meta: EntryMeta) -> str | None:
        """Why `meta` is not the entry asked for, or None if it is."""
        for name in ("fingerprint", "prefix_digest", "token_ids_hash", "dtype", "context"):
            wanted = getattr(self, name)
            if wanted is not None and getattr(meta, name) != wanted:
                return f"{name} is {getattr(meta, name)!r}, expected {wanted!r}"
        return None


def entry_from_chunk(chunk: ChunkKV, dtype: str) -> KVEntry:
    """Convert a computed chunk KV into a storable entry in `dtype` (on the CPU)."""
    kv = chunk.kv.detach().to(device="cpu", dtype=storage_dtype(dtype)).contiguous()
    meta = EntryMeta(chunk.fingerprint, chunk.prefix_digest, token_ids_hash(chunk.token_ids),
                     chunk.base_position, dtype, tuple(kv.shape), tuple(chunk.context))
    return KVEntry(meta, kv)


def chunk_from_entry(entry: KVEntry, token_ids: Sequence[int], dtype: torch.dtype,
                     device: torch.device | str = "cpu") -> ChunkKV:
    """The entry as an in-memory ChunkKV in the engine's dtype and device."""
    if token_ids_hash(token_ids) != entry.meta.token_ids_hash:
        raise ValueError("token ids do not belong to this entry")
    meta = entry.meta
    return ChunkKV(tuple(token_ids), entry.kv.to(device=device, dtype=dtype), meta.base_position,
                   meta.fingerprint, meta.prefix_digest, meta.context)
