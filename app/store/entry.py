"""What the store keeps per key: a chunk's KV encoded by a codec plus what identifies it.

A `KVEntry` is the unit every tier stores. Its `EntryMeta` says which model, system prefix
and token ids the KV belongs to, so a reader can refuse an entry that does not match what it
asked for (`EntryExpectation.mismatch`) — such an entry is a miss, never served — and which
codec (`app.store.codecs.CODECS`) encoded it. Tiers keep
and move the encoded payload; only `decode_layer` / `chunk_from_entry` turn it back into KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.store.codecs import FLOAT_CODECS, KVCodec, LayerShape, get_codec
from engine.errors import KvMosaicError
from engine.kv import ChunkId, ChunkKV, ValueRounding

# Codecs that store the KV as plain floats of this dtype (the others quantize).
STORAGE_DTYPES = FLOAT_CODECS


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


KVShape = tuple[int, int, int, int, int]  # [layers, 2, kv_heads, tokens, head_dim]


def kv_shape(shape: Sequence[int]) -> KVShape:
    """`shape` (a torch.Size, a parsed list) as a KVShape; ValueError unless it has 5 dims."""
    layers, kv, heads, tokens, dim = (int(n) for n in shape)
    return layers, kv, heads, tokens, dim


def token_ids_hash(token_ids: Sequence[int]) -> str:
    """sha256 hex of the token ids as little-endian int64."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class EntryMeta:
    """Identity and shape of a stored KV. shape: [layers, 2, kv_heads, tokens, head_dim] (the
    decoded KV); `dtype` names the codec (a float dtype or a quantized codec,
    `app.store.codecs.CODECS`)."""

    fingerprint: str
    prefix_digest: str
    token_ids_hash: str
    base_position: int
    dtype: str
    shape: KVShape
    context: tuple[ChunkId, ...] = ()
    lead: tuple[ChunkId, ...] = ()  # `engine.kv.ChunkKV.lead`: a neighbour-conditioned base

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.shape[3]

    @property
    def layer_shape(self) -> LayerShape:
        _, kv, heads, tokens, dim = self.shape
        return kv, heads, tokens, dim

    @property
    def codec(self) -> KVCodec:
        return get_codec(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        """dtype of the stored payload (uint8 for quantized codecs)."""
        return self.codec.payload_dtype

    @property
    def payload_shape(self) -> tuple[int, ...]:
        """Shape of one stored layer: layer_shape for float codecs, [bytes] for quantized ones."""
        return self.codec.payload_shape(self.layer_shape)

    @property
    def num_bytes(self) -> int:
        """Payload bytes of the KV (what tier capacities count)."""
        return self.num_layers * self.codec.layer_bytes(self.layer_shape)

    def to_json(self) -> dict[str, object]:
        return {
            "fingerprint": self.fingerprint,
            "prefix_digest": self.prefix_digest,
            "token_ids_hash": self.token_ids_hash,
            "base_position": self.base_position,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "context": list(self.context),
            "lead": list(self.lead),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EntryMeta:
        """The meta of `to_json`, parsed back from JSON (hence Any); CorruptEntry if malformed."""
        try:
            shape = tuple(int(x) for x in data["shape"])
            if len(shape) != 5 or shape[1] != 2 or min(shape) <= 0:
                raise ValueError(f"bad shape {shape}")
            get_codec(str(data["dtype"]))
            return cls(
                str(data["fingerprint"]),
                str(data["prefix_digest"]),
                str(data["token_ids_hash"]),
                int(data["base_position"]),
                str(data["dtype"]),
                kv_shape(shape),
                tuple(int(c) for c in data.get("context", ())),
                tuple(int(c) for c in data.get("lead", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptEntry(f"bad entry metadata: {exc}") from exc


@dataclass
class KVEntry:
    """meta plus kv, the stored payload [layers, *meta.payload_shape] in meta.torch_dtype,
    contiguous: for float codecs the KV itself [layers, 2, kv_heads, tokens, head_dim]."""

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
    context: tuple[ChunkId, ...] | None = None
    conditioned: bool | None = None  # a neighbour-conditioned base (a lead) or not; None: either

    def mismatch(self, meta: EntryMeta) -> str | None:
        """Why `meta` is not the entry asked for, or None if it is."""
        for name in ("fingerprint", "prefix_digest", "token_ids_hash", "dtype", "context"):
            wanted = getattr(self, name)
            if wanted is not None and getattr(meta, name) != wanted:
                return f"{name} is {getattr(meta, name)!r}, expected {wanted!r}"
        if self.conditioned is not None and bool(meta.lead) != self.conditioned:
            return f"lead is {meta.lead!r}, expected {'one' if self.conditioned else 'none'}"
        return None


def entry_from_chunk(chunk: ChunkKV, codec: str) -> KVEntry:
    """Encode a computed chunk KV into a storable entry by `codec` (on the CPU)."""
    payload = get_codec(codec).encode(chunk.kv)  # [layers, *payload_shape]
    meta = EntryMeta(
        chunk.fingerprint,
        chunk.prefix_digest,
        token_ids_hash(chunk.token_ids),
        chunk.base_position,
        codec,
        kv_shape(chunk.kv.shape),
        tuple(chunk.context),
        tuple(chunk.lead),
    )
    return KVEntry(meta, payload)


def decode_layer(
    meta: EntryMeta,
    payload: torch.Tensor,
    layer: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Stored layer number `layer` as KV [2, kv_heads, tokens, head_dim] in `dtype` on `device`.

    The payload moves to `device` first, so a quantized layer crosses to a GPU compressed.
    """
    if tuple(payload.shape) != meta.payload_shape or payload.dtype != meta.torch_dtype:
        raise CorruptEntry(
            f"stored layer {tuple(payload.shape)} {payload.dtype} does not match its meta"
        )
    if not 0 <= layer < meta.num_layers:
        raise ValueError(f"layer {layer} is not among the entry's {meta.num_layers}")
    return meta.codec.decode_layer(payload.to(device), meta.layer_shape, dtype, layer)


def chunk_from_entry(
    entry: KVEntry, token_ids: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> ChunkKV:
    """The entry decoded as an in-memory ChunkKV in the engine's dtype and device."""
    if token_ids_hash(token_ids) != entry.meta.token_ids_hash:
        raise ValueError("token ids do not belong to this entry")
    meta = entry.meta
    kv = meta.codec.decode(entry.kv.to(device), meta.layer_shape, dtype)
    return ChunkKV(
        tuple(token_ids),
        kv,
        meta.base_position,
        meta.fingerprint,
        meta.prefix_digest,
        meta.context,
        value_rounding=value_rounding(meta),
        lead=meta.lead,
    )


def value_rounding(meta: EntryMeta) -> ValueRounding | None:
    """How the entry's codec rounded its V, for the check layers (`engine.kv.KVSource`);
    None for float codecs, whose rounding is far below any deviation that matters."""
    return meta.codec.round_values if meta.codec.lossy else None


def roundtrip(chunk: ChunkKV, codec: str) -> ChunkKV:
    """`chunk` as it comes back from the store under `codec` (same dtype and device)."""
    entry = entry_from_chunk(chunk, codec)
    stored = chunk_from_entry(entry, chunk.token_ids, chunk.kv.dtype, chunk.kv.device)
    return ChunkKV(
        chunk.token_ids,
        stored.kv,
        chunk.base_position,
        chunk.fingerprint,
        chunk.prefix_digest,
        chunk.context,
        dict(chunk.meta),
        stored.value_rounding,
        chunk.lead,
    )
