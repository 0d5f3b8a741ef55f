"""KV codecs: how a chunk's KV is kept in the store, and how one layer is decoded back.

Public API:
- `KVCodec`, `LayerShape` — the contract (`base.py`): `encode` a whole entry, `decode_layer`
  one layer, `round_values` (V rows as stored and decoded), `layer_bytes`, `lossy`.
- `CODECS`, `get_codec(name)` — the one registry (`registry.py`).
- `FloatCodec` (`floats.py`), `QuantCodec` (KIVI, `kivi.py`), `RotatedQuantCodec` and
  `hadamard` (`rotated.py`) — the families.
- `pack_codes`, `unpack_codes`, `packing`, `packed_bytes`, `join_payload`, `split_payload`,
  `minmax_range`, `quantize` — the bit packing and range helpers the families share
  (`packing.py`).

No codec serializes or checksums (`app/store/codec.py` does). Bytes and fidelity of each:
docs/benchmarks/codecs.md.
"""

from app.store.codecs.base import KVCodec, LayerShape
from app.store.codecs.floats import FLOAT_CODECS, FloatCodec
from app.store.codecs.kivi import KEY_GROUP, QuantCodec
from app.store.codecs.packing import (
    join_payload,
    minmax_range,
    pack_codes,
    packed_bytes,
    packing,
    quantize,
    split_payload,
    unpack_codes,
)
from app.store.codecs.registry import CODECS, get_codec
from app.store.codecs.rotated import CLIPS, RotatedQuantCodec, hadamard

__all__ = [
    "CLIPS",
    "CODECS",
    "FLOAT_CODECS",
    "KEY_GROUP",
    "FloatCodec",
    "KVCodec",
    "LayerShape",
    "QuantCodec",
    "RotatedQuantCodec",
    "get_codec",
    "hadamard",
    "join_payload",
    "minmax_range",
    "pack_codes",
    "packed_bytes",
    "packing",
    "quantize",
    "split_payload",
    "unpack_codes",
]
