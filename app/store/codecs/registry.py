"""The codecs by name: one registry, `CODECS`, and `get_codec`.

Adding a codec is one class (or one instance of an existing one) plus one line here; the
`Codec` Literal of `app/store/config.py` names the same set (a test keeps them equal).
"""

from __future__ import annotations

from app.store.codecs.base import KVCodec
from app.store.codecs.floats import FLOAT_CODECS, FloatCodec
from app.store.codecs.kivi import QuantCodec
from app.store.codecs.rotated import RotatedQuantCodec

# the check layers of the engine's default (1, 2, 6): their V, which the selection compares with
# fresh V, gets more bits, paid for by those layers' keys (5-bit V on 1 and 2, 4-bit on 6)
CHECK_LAYER_BITS = {1: (2, 5), 2: (2, 5), 6: (3, 4)}

CODECS: dict[str, KVCodec] = {name: FloatCodec(name) for name in FLOAT_CODECS}
CODECS.update(
    {
        "int8": QuantCodec("int8", 8, 8),
        "int4": QuantCodec("int4", 4, 4),
        "k4v3": QuantCodec("k4v3", 4, 3, key_group=128),
        "h4v3": RotatedQuantCodec("h4v3", 4, 3),
        "h4v3c": RotatedQuantCodec("h4v3c", 4, 3, layer_bits=CHECK_LAYER_BITS),
        "ch4v3": RotatedQuantCodec("ch4v3", 4, 3, centre_keys=True),
        "ch4v3c": RotatedQuantCodec("ch4v3c", 4, 3, layer_bits=CHECK_LAYER_BITS, centre_keys=True),
    }
)


def get_codec(name: str) -> KVCodec:
    """The codec registered under `name`; ValueError naming the known ones otherwise."""
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; use one of {', '.join(CODECS)}")
    return CODECS[name]
