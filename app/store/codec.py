"""The serialized entry: a safetensors file, one tensor per layer, checksummed per layer.

Layout (plain safetensors, readable by `safetensors.torch.load`; never pickle):

    [8-byte little-endian header length][JSON header][layer 0 bytes][layer 1 bytes]...

The header maps `layer.0000`, `layer.0001`, ... to dtype, shape and byte offsets of each
layer's payload ([2, kv_heads, tokens, head_dim] floats, or the uint8 bytes of a quantized
layer, see `codecs/`), and `__metadata__` holds strings: `format`, `meta` (the
`EntryMeta` as JSON), `checksums` (crc32 of every layer's bytes, JSON list) and
`header_crc` (crc32 of format + meta + checksums). One tensor per layer lets a reader fetch
and verify layer i alone (`decode_layer`), so loading can start before the whole entry is read.

Every validation failure raises `CorruptEntry`; nothing here returns unverified bytes.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from app.store.entry import CorruptEntry, EntryMeta, KVEntry

FORMAT = "kvmosaic-kv/1"
MAX_HEADER_BYTES = 1 << 24
_ST_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}


@dataclass(frozen=True)
class EntryLayout:
    """A parsed, validated header: where each layer's bytes are, and their checksums.

    offsets[i] = (start, end) of layer i, absolute in the serialized entry.
    """

    meta: EntryMeta
    offsets: tuple[tuple[int, int], ...]
    checksums: tuple[int, ...]
    total_size: int


def _layer_name(index: int) -> str:
    return f"layer.{index:04d}"


def layer_bytes(layer: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    return layer.contiguous().view(torch.uint8).numpy().data.cast("B")


def encode_parts(entry: KVEntry) -> tuple[bytes, list[memoryview]]:
    """The header bytes and one buffer per layer; written in order they form the entry."""
    meta, kv = entry.meta, entry.kv.cpu()
    if tuple(kv.shape) != (meta.num_layers, *meta.payload_shape) or kv.dtype != meta.torch_dtype:
        raise ValueError(f"entry tensor {tuple(kv.shape)} {kv.dtype} does not match its meta")
    layers = [layer_bytes(kv[i]) for i in range(meta.num_layers)]
    checksums = [zlib.crc32(b) for b in layers]
    meta_json = json.dumps(meta.to_json(), sort_keys=True)
    checksums_json = json.dumps(checksums)
    # header: {"__metadata__": {str: str}, "layer.0000": {dtype, shape, data_offsets}, ...}
    metadata: dict[str, str | list[int]] = {
        "format": FORMAT,
        "meta": meta_json,
        "checksums": checksums_json,
        "header_crc": str(_header_crc(meta_json, checksums_json)),
    }
    header = {"__metadata__": metadata}
    start = 0
    for i, buf in enumerate(layers):
        header[_layer_name(i)] = {
            "dtype": _ST_DTYPES[meta.torch_dtype],
            "shape": list(meta.payload_shape),
            "data_offsets": [start, start + len(buf)],
        }
        start += len(buf)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text, layers


def encode(entry: KVEntry) -> bytes:
    header, layers = encode_parts(entry)
    return b"".join([header, *layers])


def header_length(prefix: bytes) -> int:
    """Length of the JSON header from the first 8 bytes."""
    if len(prefix) < 8:
        raise CorruptEntry("entry shorter than its header length field")
    (length,) = struct.unpack("<Q", prefix[:8])
    if not 0 < length <= MAX_HEADER_BYTES:
        raise CorruptEntry(f"implausible header length {length}")
    return int(length)


def parse_header(header: bytes, total_size: int | None) -> EntryLayout:
    """Validate a header (the 8 length bytes + JSON); `total_size` is the stored size if known."""
    length = header_length(header)
    if len(header) < 8 + length:
        raise CorruptEntry("entry truncated inside its header")
    try:
        table = json.loads(header[8 : 8 + length])
        info = table.pop("__metadata__")
        if info["format"] != FORMAT:
            raise CorruptEntry(f"unknown entry format {info['format']!r}")
        if int(info["header_crc"]) != _header_crc(info["meta"], info["checksums"]):
            raise CorruptEntry("entry header checksum mismatch")
        meta = EntryMeta.from_json(json.loads(info["meta"]))
        checksums = tuple(int(c) for c in json.loads(info["checksums"]))
        offsets = _layer_offsets(table, meta, 8 + length)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptEntry(f"unreadable entry header: {exc}") from exc
    if len(checksums) != meta.num_layers:
        raise CorruptEntry("entry has a checksum count different from its layer count")
    end = offsets[-1][1]
    if total_size is not None and total_size != end:
        raise CorruptEntry(f"entry is {total_size} bytes, its header says {end}")
    return EntryLayout(meta, offsets, checksums, end)


def _layer_offsets(
    table: dict[str, Any], meta: EntryMeta, data_start: int
) -> tuple[tuple[int, int], ...]:
    """Absolute (start, end) of each layer; `table` is the parsed JSON header (hence Any),
    every field of which is checked against `meta` here."""
    layer_size = meta.num_bytes // meta.num_layers
    offsets, expected = [], 0
    for i in range(meta.num_layers):
        spec = table[_layer_name(i)]
        start, end = (int(x) for x in spec["data_offsets"])
        if (
            spec["dtype"] != _ST_DTYPES[meta.torch_dtype]
            or tuple(spec["shape"]) != meta.payload_shape
        ):
            raise CorruptEntry(f"layer {i} header does not match the entry meta")
        if start != expected or end - start != layer_size:
            raise CorruptEntry(f"layer {i} offsets are inconsistent")
        offsets.append((data_start + start, data_start + end))
        expected = end
    if len(table) != meta.num_layers:
        raise CorruptEntry("entry has tensors beyond its layers")
    return tuple(offsets)


def verify_layer(layout: EntryLayout, index: int, raw: bytes | bytearray | memoryview) -> None:
    """Raise CorruptEntry unless `raw` is exactly layer `index`'s bytes."""
    start, end = layout.offsets[index]
    if len(raw) != end - start:
        raise CorruptEntry(f"layer {index} is {len(raw)} bytes, expected {end - start}")
    if zlib.crc32(raw) != layout.checksums[index]:
        raise CorruptEntry(f"layer {index} checksum mismatch")


def decode_layer(
    layout: EntryLayout, index: int, raw: bytes | bytearray | memoryview
) -> torch.Tensor:
    """Layer `index`'s payload from its raw bytes, checksum verified: [*meta.payload_shape].

    A bytearray is wrapped without copying (the tensor then owns it); anything else is copied.
    """
    verify_layer(layout, index, raw)
    buffer = raw if isinstance(raw, bytearray) else bytearray(raw)
    return torch.frombuffer(buffer, dtype=layout.meta.torch_dtype).view(layout.meta.payload_shape)


def decode(data: bytes | bytearray | memoryview) -> KVEntry:
    """A whole serialized entry, every layer verified; kv: [layers, *meta.payload_shape].

    A bytearray is wrapped without copying (the tensor then owns it); anything else is copied once.
    """
    view = memoryview(data).cast("B")
    length = header_length(bytes(view[:8]))
    layout = parse_header(bytes(view[: 8 + length]), len(view))
    for i, (start, end) in enumerate(layout.offsets):
        verify_layer(layout, i, view[start:end])
    start = layout.offsets[0][0]
    buffer, offset = (data, start) if isinstance(data, bytearray) else (bytearray(view[start:]), 0)
    count = layout.meta.num_bytes // layout.meta.torch_dtype.itemsize
    kv = torch.frombuffer(buffer, dtype=layout.meta.torch_dtype, count=count, offset=offset)
    return KVEntry(layout.meta, kv.view(layout.meta.num_layers, *layout.meta.payload_shape))


def _header_crc(meta_json: str, checksums_json: str) -> int:
    return zlib.crc32(f"{FORMAT}\n{meta_json}\n{checksums_json}".encode())
