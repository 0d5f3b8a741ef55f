"""KV codecs: sizes, round-trip error bounds, serialization, layer-wise decoding, damage."""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from app.store import CorruptEntry, StoreConfig, create_tier
from app.store import codec as entry_codec
from app.store.codecs import QuantCodec, get_codec, pack_codes, packed_bytes, unpack_codes
from app.store.entry import (
    EntryMeta,
    KVEntry,
    chunk_from_entry,
    decode_layer,
    entry_from_chunk,
    roundtrip,
)
from app.store.lazy import LazyChunkKV
from engine.kv import ChunkKV
from tests.app.store.helpers import key_of

# [layers, 2, kv_heads, tokens, head_dim]; 100 tokens: a partial key group
SHAPE = (3, 2, 3, 100, 64)


def _kv(seed: int = 0, shape=SHAPE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=generator)
    kv[:, 0, :, :, 5] *= 20  # an outlier key channel, as real models have
    return kv


def _chunk(kv: torch.Tensor) -> ChunkKV:
    return ChunkKV(tuple(range(kv.shape[3])), kv, 7, "fp", "prefix", (3, 1))


def test_bad_codec_names_are_refused():
    with pytest.raises(ValueError, match="k4v3"):
        get_codec("int3")
    with pytest.raises(ValueError):
        QuantCodec("k4v9", 4, 9)
    assert StoreConfig(codec="k4v3").codec == "k4v3"
    with pytest.raises(ValueError):
        StoreConfig(codec="fp8")


@pytest.mark.parametrize(
    "name, ratio",
    [
        ("float16", 1.0),
        ("int8", 0.52),
        ("int4", 0.27),
        ("k4v3", 0.24),
        ("h4v3", 0.25),
        ("h4v3c", 0.25),
        ("ch4v3", 0.244),
        ("ch4v3c", 0.244),
    ],
)
def test_payload_bytes_per_token(name, ratio):
    layer_shape = (2, 3, 256, 64)
    float16_bytes = 2 * 3 * 256 * 64 * 2
    got = get_codec(name).layer_bytes(layer_shape) / float16_bytes
    assert got == pytest.approx(ratio, abs=0.02)
    entry = entry_from_chunk(_chunk(_kv(shape=(4, *layer_shape))), name)
    assert (
        entry.num_bytes
        == entry.kv.numel() * entry.kv.element_size()
        == 4 * get_codec(name).layer_bytes(layer_shape)
    )


@pytest.mark.parametrize(
    "name, tokens",
    [
        ("k4v3", 256),
        ("k4v3", 206),
        ("h4v3", 256),
        ("h4v3", 206),
        ("h4v3", 1),
        ("h4v3c", 206),
        ("ch4v3", 206),
        ("ch4v3c", 64),
    ],
)
def test_four_three_bit_codecs_are_at_most_a_quarter_of_float16(name, tokens):
    """k4v3 from a key group's worth of tokens on (its per-channel scales); h4v3 at any length."""
    layer_shape = (2, 3, tokens, 64)  # SmolLM2's; 206 tokens: a partial key group
    assert get_codec(name).layer_bytes(layer_shape) <= 0.25 * get_codec("float16").layer_bytes(
        layer_shape
    )


def test_quantized_payloads_are_unchanged():
    """Stored entries keep decoding as they did and a chunk's stored bytes stay what its codec
    wrote: int8 / int4 as before k4v3 existed, k4v3 / h4v3 as when they were added (h4v3's
    faster clip search picks the same ranges)."""
    kv = _kv(17, shape=(2, 2, 3, 100, 64))
    digests = {
        "int8": "04cdf82deb3704e5b93f6c148c8c01d61d4d08e5ed497b6af72a1182aed0611f",
        "int4": "5caf49c90c5e11471756f63fb2a3d35a8ccf6329444b9e9ad36fd3eff37e2c57",
        "k4v3": "704a415f60f23b34eb4b7ad921643736e696243a73f589856baac83ad661f0fd",
        "h4v3": "fc9b10c1c1091b81407ff16db8324bb298f6c319e39dadc0ac9aba8fe41f3bb9",
    }
    for name, digest in digests.items():
        payload = get_codec(name).encode(kv)
        assert hashlib.sha256(payload.numpy().tobytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name", ["int8", "int4", "k4v3"])
@pytest.mark.parametrize("tokens", [100, 128, 206])  # partial and whole key groups of 64 and 128
def test_quantization_error_is_within_half_a_step(name, tokens):
    codec = get_codec(name)
    assert isinstance(codec, QuantCodec)
    shape = (3, 2, 3, tokens, 64)
    kv = _kv(1, shape)
    decoded = codec.decode(codec.encode(kv), shape[1:], torch.float32)
    assert decoded.shape == kv.shape
    keys, values = kv[:, 0], kv[:, 1]
    group = codec.key_group
    # keys: per (head, dim) channel over groups of key_group tokens
    groups = [keys[:, :, g : g + group] for g in range(0, tokens, group)]
    key_range = torch.cat(
        [(g.amax(2, keepdim=True) - g.amin(2, keepdim=True)).expand_as(g) for g in groups], 2
    )
    key_step = key_range / ((1 << codec.key_bits) - 1)
    value_step = (values.amax(3, keepdim=True) - values.amin(3, keepdim=True)) / (
        (1 << codec.value_bits) - 1
    )
    slack = 1e-2  # float16 scale / minimum rounding
    assert bool(((decoded[:, 0] - keys).abs() <= key_step * (0.5 + slack) + 1e-3).all())
    assert bool(((decoded[:, 1] - values).abs() <= value_step * (0.5 + slack) + 1e-3).all())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("count", [1, 7, 8, 9, 13, 24, 1001])
def test_pack_and_unpack_codes(bits, count):
    generator = torch.Generator().manual_seed(count)
    codes = torch.randint(0, 1 << bits, (2, count), generator=generator, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, packed_bytes(count, bits))
    for row in range(2):
        assert torch.equal(unpack_codes(packed[row], bits, count), codes[row])


def test_three_bit_packing_is_little_endian_eight_codes_in_three_bytes():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0, 5]], dtype=torch.uint8)
    word = sum(int(c) << 3 * i for i, c in enumerate(codes[0, :8].tolist()))
    expected = list(word.to_bytes(3, "little")) + [5, 0, 0]  # the ninth code, padded to a word
    assert pack_codes(codes, 3)[0].tolist() == expected
    assert packed_bytes(9, 3) == 6 and packed_bytes(8, 3) == 3 and packed_bytes(9, 4) == 5


def test_five_bit_packing_is_little_endian_eight_codes_in_five_bytes():
    codes = torch.tensor([[31, 1, 30, 2, 29, 3, 28, 4]], dtype=torch.uint8)
    word = sum(int(c) << 5 * i for i, c in enumerate(codes[0].tolist()))
    assert pack_codes(codes, 5)[0].tolist() == list(word.to_bytes(5, "little"))
    assert packed_bytes(8, 5) == 5 and packed_bytes(9, 5) == 10 and packed_bytes(9, 2) == 3


@pytest.mark.parametrize("bits", [0, 9])
def test_codes_wider_than_a_byte_or_empty_are_refused(bits):
    with pytest.raises(ValueError, match="1 to 8 bits"):
        packed_bytes(8, bits)


@pytest.mark.parametrize("name", ["int4", "k4v3"])
def test_per_channel_keys_keep_an_outlier_channel_from_flooding_the_others(name):
    kv = _kv(2)
    decoded = get_codec(name).decode(get_codec(name).encode(kv), SHAPE[1:], torch.float32)
    normal = [c for c in range(64) if c != 5]
    error = (decoded[:, 0, :, :, normal] - kv[:, 0, :, :, normal]).abs().mean()
    assert error < 0.2  # a per-token key scale would be set by the x20 channel: error ~1


def test_constant_groups_and_float_codecs_round_trip():
    kv = torch.full(SHAPE, 0.75)
    for name in ("int8", "int4", "k4v3", "float32"):
        assert torch.equal(
            get_codec(name).decode(get_codec(name).encode(kv), SHAPE[1:], torch.float32), kv
        )
    kv = _kv(3)
    assert torch.equal(
        get_codec("float16").decode(get_codec("float16").encode(kv), SHAPE[1:], torch.float32),
        kv.half().float(),
    )


@pytest.mark.parametrize("name", ["int8", "int4", "k4v3", "h4v3", "h4v3c", "ch4v3c"])
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
        rounding = source.value_rounding
        source.close()
    assert torch.equal(torch.stack(layers), whole.kv)
    assert rounding is not None
    assert all(
        torch.equal(rounding(chunk.kv[layer, 1], layer), whole.kv[layer, 1])
        for layer in range(SHAPE[0])
    )
    # one flipped byte inside layer 1: its checksum refuses it, layer 0 still decodes
    path = tier.path(key)
    data = bytearray(path.read_bytes())
    layout = entry_codec.parse_header(bytes(data[: 8 + entry_codec.header_length(data)]), len(data))
    data[layout.offsets[1][0] + 3] ^= 0x40
    path.write_bytes(bytes(data))
    with tier.open(key) as reader:
        assert torch.equal(
            decode_layer(reader.meta, reader.layer(0), 0, torch.float32), whole.kv[0]
        )
        with pytest.raises(CorruptEntry):
            reader.layer(1)


def test_decode_layer_refuses_a_payload_of_the_wrong_shape():
    entry = entry_from_chunk(_chunk(_kv(5)), "int4")
    with pytest.raises(CorruptEntry):
        decode_layer(entry.meta, entry.kv[0][:-2], 0, torch.float32)
    meta = EntryMeta("fp", "prefix", "0" * 64, 0, "int8", SHAPE)  # claims int8, holds int4 bytes
    with pytest.raises(CorruptEntry):
        decode_layer(meta, entry.kv[0], 0, torch.float32)


def test_meta_names_an_unknown_codec_as_corrupt():
    meta = EntryMeta("fp", "prefix", "0" * 64, 0, "int4", SHAPE).to_json()
    with pytest.raises(CorruptEntry):
        EntryMeta.from_json({**meta, "dtype": "int2"})
    assert math.prod(EntryMeta.from_json(meta).payload_shape) == get_codec("int4").layer_bytes(
        SHAPE[1:]
    )


def test_memory_tier_keeps_the_encoded_payload():
    tier = create_tier("cpu", StoreConfig())
    entry = entry_from_chunk(_chunk(_kv(6)), "int4")
    tier.put(key_of("m"), entry)
    assert (
        tier.used_bytes()
        == entry.num_bytes
        < entry_from_chunk(_chunk(_kv(6)), "float16").num_bytes / 3
    )
    assert isinstance(tier.get(key_of("m")), KVEntry)


@pytest.mark.parametrize(
    "name", ["float16", "int8", "int4", "k4v3", "h4v3", "h4v3c", "ch4v3", "ch4v3c"]
)
def test_round_values_reads_back_as_the_stored_values(name):
    """What the check layers compare with: fresh V rounded as the codec would store it equals
    the V a stored entry decodes to, so unchanged rows compare equal."""
    kv = _kv(5)
    codec = get_codec(name)
    stored = codec.decode(codec.encode(kv), SHAPE[1:], torch.float32)[:, 1]
    rounded = torch.stack([codec.round_values(kv[layer, 1], layer) for layer in range(kv.shape[0])])
    assert rounded.dtype == torch.float32 and rounded.shape == stored.shape
    assert torch.equal(rounded, stored)
    rows = codec.round_values(kv[1, 1, :, 7:9], 1)  # any rows round alike: per (head, token) row
    assert torch.equal(rows, stored[1, :, 7:9])


def test_chunks_from_lossy_entries_carry_their_codec_rounding():
    chunk = _chunk(_kv(6))
    assert roundtrip(chunk, "float16").value_rounding is None  # float rounding is left alone
    rounding = roundtrip(chunk, "h4v3").value_rounding
    assert rounding is not None
    stored = roundtrip(chunk, "h4v3").kv[:, 1]
    assert all(
        torch.equal(rounding(chunk.kv[layer, 1], layer), stored[layer])
        for layer in range(stored.shape[0])
    )
