"""The serialized entry: plain safetensors, checksummed; every kind of damage is refused."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import safetensors.torch
import torch

from app.store import CorruptEntry, StoreConfig, codec, create_tier
from app.store.entry import EntryMeta, chunk_from_entry, entry_from_chunk, roundtrip
from app.store.lazy import LazyChunkKV
from engine.kv import ChunkKV, exact_context
from tests.app.store.helpers import key_of, make_entry, same_entry

K = key_of("entry")


def test_entry_is_plain_safetensors():
    entry = make_entry(1, layers=4)
    data = codec.encode(entry)
    tensors = safetensors.torch.load(data)
    assert sorted(tensors) == [f"layer.{i:04d}" for i in range(4)]
    assert all(torch.equal(tensors[f"layer.{i:04d}"], entry.kv[i]) for i in range(4))
    assert same_entry(codec.decode(data), entry)
    assert b"pickle" not in data and not data.startswith(b"\x80")


def _damaged(kind: str, data: bytes) -> bytes:
    layout = codec.parse_header(data[: 8 + codec.header_length(data)], len(data))
    if kind == "flip_data":
        start, end = layout.offsets[1]
        at = (start + end) // 2
        return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
    if kind == "flip_header":
        at = data.index(b"fp-test")
        return data[:at] + b"fp-tesu" + data[at + 7 :]
    if kind == "truncate":
        return data[:-7]
    if kind == "extend":
        return data + b"\0" * 8
    if kind == "garbage":
        return os.urandom(len(data))
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["flip_data", "flip_header", "truncate", "extend", "garbage"])
def test_decode_refuses_damage(kind):
    with pytest.raises(CorruptEntry):
        codec.decode(_damaged(kind, codec.encode(make_entry(2))))


@pytest.mark.parametrize("kind", ["flip_data", "flip_header", "truncate", "extend", "garbage"])
def test_disk_tier_refuses_damaged_files(tmp_path, kind):
    from app.store import StoreConfig

    tier = create_tier("disk", StoreConfig(disk_dir=tmp_path, disk_fsync=False))
    entry = make_entry(3)
    tier.put(K, entry)
    path = tier.path(K)
    path.write_bytes(_damaged(kind, path.read_bytes()))
    with pytest.raises(CorruptEntry):
        tier.get(K)
    if kind == "flip_data":  # the header is fine: the damaged layer alone is refused
        with tier.open(K) as reader:
            assert torch.equal(reader.layer(0), entry.kv[0])
            with pytest.raises(CorruptEntry):
                reader.layer(1)
    else:
        with pytest.raises(CorruptEntry):
            tier.open(K)


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["flip_data", "truncate"])
def test_redis_tier_refuses_damaged_values(redis_prefix, kind):
    import redis

    from app.store import StoreConfig
    from tests.app.store.conftest import REDIS_URL

    tier = create_tier("redis", StoreConfig(redis_url=REDIS_URL, redis_prefix=redis_prefix))
    tier.put(K, make_entry(4))
    client = redis.Redis.from_url(REDIS_URL)
    client.set(tier.data_key(K), _damaged(kind, client.get(tier.data_key(K))))
    with pytest.raises(CorruptEntry):
        tier.get(K)
    tier.close()


def test_disk_start_up_scan_cleans_temp_and_unreadable_files(tmp_path):
    from app.store.disk import DiskTier

    tier = DiskTier(1 << 20, tmp_path, fsync=False)
    entry = make_entry(5)
    tier.put(K, entry)
    tier.put(key_of("bad"), make_entry(6))
    tier.path(key_of("bad")).write_bytes(b"not an entry")
    stray = tier.path(K).with_name(f".{K}.deadbeef.tmp")
    stray.write_bytes(b"half written")
    again = DiskTier(1 << 20, tmp_path, fsync=False)  # a restart
    assert again.keys() == {K: entry.num_bytes}
    assert not stray.exists() and not again.path(key_of("bad")).exists()
    assert same_entry(again.get(K), entry)


def test_a_conditioned_bases_lead_survives_the_store(tmp_path):
    # a neighbour-conditioned base read back without its lead would pass for an exact base

    kv = torch.randn(2, 2, 1, 5, 4)
    chunk = ChunkKV(tuple(range(5)), kv, 19, "fp", "prefix", lead=(8, 3))
    entry = entry_from_chunk(chunk, "float32")
    assert EntryMeta.from_json(entry.meta.to_json()).lead == (8, 3)
    assert chunk_from_entry(entry, chunk.token_ids, torch.float32).lead == (8, 3)
    assert roundtrip(chunk, "int8").lead == (8, 3)
    tier = create_tier("disk", StoreConfig(disk_dir=tmp_path, disk_fsync=False))
    tier.put(key_of("lead"), entry)
    with ThreadPoolExecutor(1) as pool:
        source = LazyChunkKV(tier.open(key_of("lead")), pool, torch.float32, prefetch=1)
        assert source.lead == (8, 3) and exact_context(source) is None
        source.close()
