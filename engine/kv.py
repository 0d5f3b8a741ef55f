"""KV tensors: a chunk's cached KV, the request's assembled cache, and the source protocol.

A chunk's KV is computed once, alone, right after the system prefix, so it sits at positions
`base_position .. base_position + tokens - 1` with K already rotated by RoPE there. At use,
the runner copies it layer by layer into the request's cache and rotates K by the position
delta; V is position-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.ape import ContextReading
from engine.errors import InvalidRequest

# A chunk's id: the catalog's row id (benchmarks number their chunks). Contexts, Cache-Craft
# statistics and reports all use it; only the catalog and the store's metadata hold it as text.
ChunkId = int

# How a lossy store codec rounded a chunk's V: (rows [..., head_dim] of one layer, that layer's
# number) -> the same rows as they would read back had they been stored (same dtype and device).
ValueRounding = Callable[[torch.Tensor, int], torch.Tensor]


class KVSource(Protocol):
    """Anything that yields one layer of a chunk's cached KV at a time.

    `layer(i)` returns [2, kv_heads, tokens, head_dim] (K then V). Implementations may load
    lazily (the store prefetches layer i + 1 while the runner computes layer i); the runner
    asks for layers in increasing order and may skip layers.
    `fingerprint` (model) and `prefix_digest` (system prefix) must match the engine's, and
    `context` is the ordered ids of the chunks that preceded the chunk when it was computed;
    `lead` the ids of chunks whose opening rows only (cut) preceded it before those (a
    neighbour-conditioned base: exact in no prompt, `exact_context` None).
    `value_rounding` is how a lossy store codec rounded its V (None: V is as computed, or kept
    in a float dtype); the check layers round fresh V the same way before comparing, so the
    codec's noise does not read as deviation (planners/selection.py).
    """

    # read-only: a frozen record (ChunkKV) and a lazy reader (LazyChunkKV) both qualify
    @property
    def num_tokens(self) -> int: ...
    @property
    def base_position(self) -> int: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def prefix_digest(self) -> str: ...
    @property
    def context(self) -> tuple[ChunkId, ...]: ...
    @property
    def lead(self) -> tuple[ChunkId, ...]: ...
    @property
    def value_rounding(self) -> ValueRounding | None: ...

    def layer(self, index: int) -> torch.Tensor: ...


def exact_context(kv: KVSource | None) -> tuple[ChunkId, ...] | None:
    """The context after which `kv`'s rows equal a full prefill's (to float tolerance): its
    `context`, or None when there is no KV or a lossy store codec rounded it. A lossy copy of
    an exact variant is close, not exact: its rows count as exact only once recomputed, so
    the fidelity guard checks such requests and re-runs start before such chunks."""
    if kv is None or kv.value_rounding is not None or kv.lead:
        return None
    return tuple(kv.context)


@dataclass
class ChunkKV:
    """One chunk's cached KV in memory, with what is needed to reuse it safely.

    kv: [layers, 2, kv_heads, tokens, head_dim]; index 0 of dim 1 is K (after RoPE at
    base_position + t), index 1 is V.
    `context` is the ordered ids of the chunks that preceded it when it was computed
    (empty for the base variant, computed alone after the system prefix). `lead`: the ids of
    chunks whose cut openings preceded it, before `context` (`Engine.encode_after`; empty for
    every variant but a neighbour-conditioned base, which is exact in no prompt).
    """

    token_ids: tuple[int, ...]
    kv: torch.Tensor
    base_position: int
    fingerprint: str
    prefix_digest: str
    context: tuple[ChunkId, ...] = ()
    meta: dict[str, object] = field(default_factory=dict)
    value_rounding: ValueRounding | None = field(default=None, compare=False, repr=False)
    lead: tuple[ChunkId, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3]

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, index: int) -> torch.Tensor:
        return self.kv[index]


class KVCache:
    """The request's assembled cache, preallocated for prompt plus generated tokens.

    data: [layers, 2, kv_heads, capacity, head_dim]; rows [0, length) are valid. `reading`:
    how rows after the prompt's contexts read them (APE's, engine/ape.py; None: plainly),
    set by the prefill that filled the cache and followed by every decode step from it.
    """

    reading: ContextReading | None = None  # a class default: a cache built bare reads plainly

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.data = torch.empty(
            num_layers, 2, num_kv_heads, capacity, head_dim, dtype=dtype, device=device
        )
        self.length = 0
        self._decoding = False

    def claim_for_decode(self) -> None:
        """Decoding appends to the cache, so a cache is decoded from once."""
        if self._decoding:
            raise InvalidRequest("this prefill result has already been decoded")
        self._decoding = True

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def copy(self, capacity: int | None = None) -> KVCache:
        """A new cache of `capacity` rows (default: this one's) holding a copy of the valid
        rows, not yet decoded from."""
        data = self.data
        copy = KVCache(
            data.shape[0],
            data.shape[2],
            data.shape[4],
            self.capacity if capacity is None else capacity,
            data.dtype,
            data.device,
        )
        copy.data[:, :, :, : self.length] = data[:, :, :, : self.length]
        copy.length = self.length
        copy.reading = self.reading
        return copy

    def keys(self, layer: int, end: int) -> torch.Tensor:
        return self.data[layer, 0, :, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self.data[layer, 1, :, :end]

    def rows(self, start: int, end: int) -> torch.Tensor:
        """A copy of rows [start, end) of every layer:
        [layers, 2, kv_heads, end - start, head_dim]."""
        return self.data[:, :, :, start:end].clone()
