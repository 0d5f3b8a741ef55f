"""Former home of the KV codecs, kept so that older imports work: use `app.store.codecs`."""

from app.store.codecs import (
    CODECS,
    FLOAT_CODECS,
    KEY_GROUP,
    FloatCodec,
    KVCodec,
    LayerShape,
    QuantCodec,
    get_codec,
    join_payload,
    pack_codes,
    packed_bytes,
    packing,
    split_payload,
    unpack_codes,
)

__all__ = [
    "CODECS",
    "FLOAT_CODECS",
    "KEY_GROUP",
    "FloatCodec",
    "KVCodec",
    "LayerShape",
    "QuantCodec",
    "get_codec",
    "join_payload",
    "pack_codes",
    "packed_bytes",
    "packing",
    "split_payload",
    "unpack_codes",
]
