"""KV codecs: sizes, round-trip error bounds, serialization, layer-wise decoding, damage."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.kv import ChunkKV
from app.store import CorruptEntry, StoreConfig, create_tier
from app.store import codec as entry_codec
from app.store.entry import EntryMeta, KVEntry, chunk_from_entry, decode_layer, entry_from_chunk, roundtrip
from app.store.lazy import LazyChunkKV
from app.store.quant import CODECS, KEY_GROUP, QuantCodec, get_codec
from tests.app.store.helpers import key_of

SHAPE = (3, 2, 3, 100, 64)  # [layers, 2, kv_heads, tokens, head_dim]; 100 tokens: a partial key group


def _kv(seed: int = 0, shape=SHAPE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=generator)
    kv[:, 0, :, :, 5] *= 20  # an outlier key channel, as real models have
    return kv


def _chunk(kv: torch.Tensor) -> ChunkKV:
    return ChunkKV(tuple(range(kv.shape[3])), kv, 7, "fp", "prefix", (3, 1))


def test_registry_and_bad_names():
    assert set(CODECS) == {"float16", "bfloat16", "float32", "int8", "int4"}
    with pytest.raises(ValueError, match="int4"):
        get_codec("int3")
    with pytest.raises(ValueError):
        QuantCodec(3)
    with pytest.raises(ValueError):
        StoreConfig(codec="fp8")


@pytest.mark.parametrize("name, ratio", [("float16", 1.0), ("int8", 0.52), ("int4", 0.27)])
def test_payload_bytes_per_token(name, ratio):
    layer_shape = (2, 3, 256, 64)
    float16_bytes = 2 * 3 * 256 * 64 * 2
    got = get_codec(name).layer_bytes(layer_shape) / float16_bytes
    assert got == pytest.approx(ratio, abs=0.02)
    entry = entry_from_chunk(_chunk(_kv(shape=(4, *layer_shape))), name)
    assert entry.num_bytes == entry.kv.numel() * entry.kv.element_size() == 4 * get_codec(name).layer_bytes(layer_shape)


@pytest.mark.parametrize("name, bits", [("int8", 8), ("int4", 4)])
def test_quantization_error_is_within_half_a_step(name, bits):
    kv = _kv(1)
    decoded = get_codec(name).decode(get_codec(name).encode(kv), SHAPE[1:], torch.float32)
    levels = (1 << bits) - 1
    keys, values = kv[:, 0], kv[:, 1]
    # keys: per (head, dim) channel over groups of KEY_GROUP tokens
    groups = [keys[:, :, g:g + KEY_GROUP] for g in range(0, SHAPE[3], KEY_GROUP)]
    key_step = torch.cat([(g.amax(2, keepdim=True) - g.amin(2, keepdim=True)).expand_as(g) for g in groups], 2) / levels
    value_step = (values.amax(3, keepdim=True) - values.amin(3, keepdim=True)) / levels  # per token
    slack = 1e-2  # float16 scale / minimum rounding
    assert bool(((decoded[:, 0] - keys).abs() <= key_step * (0.5 + slack) + 1e-3).all())
    assert bool(((decoded[:, 1] - values).abs() <= value_step * (0.5 + slack) + 1e-3).all())


def test_per_channel_keys_keep_an_outlier_channel_from_flooding_the_others():
    kv = _kv(2)
    decoded = get_codec("int4").decode(get_codec("int4").encode(kv), SHAPE[1:], torch.float32)
    normal = [c for c in range(64) if c != 5]
    error = (decoded[:, 0, :, :, normal] - kv[:, 0, :, :, normal]).abs().mean()
    assert error < 0.2  # a per-token key scale would be set by the x20 channel: error ~1


def test_constant_groups_and_float_codecs_round_trip():
    kv = torch.full(SHAPE, 0.75)
    for name in ("int8", "int4", "float32"):
        assert torch.equal(get_codec(name).decode(get_codec(name).encode(kv), SHAPE[1:], torch.float32), kv)
    kv = _kv(3)
    assert torch.equal(get_codec("float16").decode(get_codec("float16").encode(kv), SHAPE[1:], torch.float32),
                       kv.half().float())


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_entry_serializes_checksummed_and_decodes_layer_by_layer(tmp_path, name):
    chunk = _chunk(_kv(4))
    entry = entry_from_chunk(chunk, name)
    assert entry.kv.dtype == torch.uint8 and entry.meta.dtype == name and entry.meta.shape == SHAPE
    back = entry_codec.decode(entry_codec.encode(entry))
    assert back.meta == entry.meta and torch.equal(back.kv, entry.kv)
    whole = chunk_from_entry(back, chunk.token_ids, torch.float32)
    assert torch.equal(whole.kv, roundtrip(chunk, name).kv)
    tier = create_tier("disk", StoreConfig(disk_dir=tmp_path, disk_fsync=False))
    key = key_of(name)
    tier.put(key, entry)
    assert tier.keys() == {key: entry.num_bytes}
    with ThreadPoolExecutor(2) as pool:
        source = LazyChunkKV(tier.open(key), pool, torch.float32, prefetch=1)
        layers = [source.layer(i) for i in range(SHAPE[0])]
        source.close()
    assert torch.equal(torch.stack(layers), whole.kv)
    # one flipped byte inside layer 1: its checksum refuses it, layer 0 still decodes
    path = tier.path(key)
    data = bytearray(path.read_bytes())
    layout = entry_codec.parse_header(bytes(data[:8 + entry_codec.header_length(data)]), len(data))
    data[layout.offsets[1][0] + 3] ^= 0x40
    path.write_bytes(bytes(data))
    with tier.open(key) as reader:
        assert torch.equal(decode_layer(reader.meta, reader.layer(0), torch.float32), whole.kv[0])
        with pytest.raises(CorruptEntry):
            reader.layer(1)


def test_decode_layer_refuses_a_payload_of_the_wrong_shape():
    entry = entry_from_chunk(_chunk(_kv(5)), "int4")
    with pytest.raises(CorruptEntry):
        decode_layer(entry.meta, entry.kv[0][:-2], torch.float32)
    meta = EntryMeta("fp", "prefix", "0" * 64, 0, "int8", SHAPE)  # claims int8, holds int4 bytes
    with pytest.raises(CorruptEntry):
        decode_layer(meta, entry.kv[0], torch.float32)


def test_meta_names_an_unknown_codec_as_corrupt():
    meta = EntryMeta("fp", "prefix", "0" * 64, 0, "int4", SHAPE).to_json()
    with pytest.raises(CorruptEntry):
        EntryMeta.from_json({**meta, "dtype": "int2"})
    assert math.prod(EntryMeta.from_json(meta).payload_shape) == get_codec("int4").layer_bytes(SHAPE[1:])


def test_memory_tier_keeps_the_encoded_payload():
    tier = create_tier("cpu", StoreConfig())
    entry = entry_from_chunk(_chunk(_kv(6)), "int4")
    tier.put(key_of("m"), entry)
    assert tier.used_bytes() == entry.num_bytes < entry_from_chunk(_chunk(_kv(6)), "float16").num_bytes / 3
    assert isinstance(tier.get(key_of("m")), KVEntry)
