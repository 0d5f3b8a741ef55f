"""The KV codecs' names, importable without torch: the CLI offers them as choices before any
model loads, and the settings type their fields with them. `app/store/codecs/registry.py`
registers exactly these (tests/app/store/test_config_and_bench.py checks the two agree)."""

from __future__ import annotations

from typing import Literal, get_args

Codec = Literal[
    "float16", "bfloat16", "float32", "int8", "int4", "k4v3", "h4v3", "h4v3c", "ch4v3", "ch4v3c"
]
CODEC_NAMES: tuple[str, ...] = get_args(Codec)
# a variant's codec: one of the codecs, or `auto` (the store's own)
VariantCodec = Literal["auto", Codec]
# the store's codec: one of the codecs, or `auto` (by the model's dtype: StoreConfig.for_model)
StoreCodec = Literal["auto", Codec]
