"""Helpers for store tests: deterministic entries and keys."""

from __future__ import annotations

import hashlib

import torch

from app.store import EntryMeta, KVEntry
from app.store.entry import storage_dtype


def key_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def make_entry(
    seed: int = 0,
    layers: int = 3,
    heads: int = 2,
    tokens: int = 5,
    dim: int = 4,
    dtype: str = "float16",
    fingerprint: str = "fp-test",
    context: tuple[str, ...] = (),
) -> KVEntry:
    """An entry whose values are determined by `seed` (so a torn read is detectable)."""
    generator = torch.Generator().manual_seed(seed)
    # kv: [layers, 2, kv_heads, tokens, head_dim]
    kv = torch.randn(layers, 2, heads, tokens, dim, generator=generator).to(storage_dtype(dtype))
    meta = EntryMeta(fingerprint, "prefix-test", f"{seed:064x}", 7, dtype, tuple(kv.shape), context)
    return KVEntry(meta, kv)


def same_entry(a: KVEntry, b: KVEntry) -> bool:
    return a.meta == b.meta and torch.equal(a.kv.cpu(), b.kv.cpu())
