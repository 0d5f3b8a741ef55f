"""ChunkKVCache with the tiny engine: cold and warm loads agree exactly, damaged entries are
recomputed (same answer as a cold run), variants and evictions reach the catalog."""

from __future__ import annotations

import hashlib

import pytest
import torch

from app.catalog import MISSING, READY, Catalog, CatalogConfig, NewChunk, VariantStats
from app.kvcache.cache import ChunkKVCache
from app.kvcache.variants import ChunkRef
from app.store import LazyChunkKV, StoreConfig, create_store
from app.store.entry import EntryMeta, KVEntry
from engine.planners import Mode
from tests.engine.helpers import PASSAGES, QUESTION


@pytest.fixture
def catalog(tmp_path):
    catalog = Catalog.open(CatalogConfig(data_dir=tmp_path))
    yield catalog
    catalog.close()


@pytest.fixture
def refs(tiny_engine, catalog) -> list[ChunkRef]:
    ids = [tiny_engine.chunk_ids(text, title) for title, text in PASSAGES]
    new = [
        NewChunk(text, len(i), hashlib.sha256(repr(i).encode()).hexdigest())
        for (_, text), i in zip(PASSAGES, ids)
    ]
    added = catalog.add_document("passages", "Passages", "0" * 64, new)
    return [ChunkRef(c.id, i) for c, i in zip(added.chunks, ids)]


def make_cache(engine, catalog, tmp_path, **config) -> ChunkKVCache:
    settings = dict(tiers=("cpu", "disk"), disk_dir=tmp_path / "kv", disk_fsync=False)
    settings.update(config)
    store_config = StoreConfig(**settings).for_model("float32")  # the tiny engine's dtype
    return ChunkKVCache.open(
        engine,
        create_store(store_config),
        catalog,
        storage_dtype=store_config.codec,
        variant_dtype=store_config.context_variant_codec,
    )


def prefill_logits(engine, cache, refs, mode="cacheblend"):
    with cache.loader.load(refs) as loaded:
        result = engine.prefill(loaded.inputs, QUESTION, mode=Mode.named(mode))
        return result.logits, loaded


def test_cold_then_warm_is_identical(tiny_engine, catalog, refs, tmp_path):
    cache = make_cache(tiny_engine, catalog, tmp_path)
    cold, loaded = prefill_logits(tiny_engine, cache, refs)
    assert loaded.computed == [r.chunk_id for r in refs]
    for ref in refs:
        (variant,) = catalog.variants_of_chunk(ref.chunk_id)
        assert variant.status == READY and variant.tier == "cpu" and variant.context == ()
        assert variant.model_fingerprint == tiny_engine.fingerprint and variant.access_count == 1
    warm, loaded = prefill_logits(tiny_engine, cache, refs)
    assert loaded.computed == []
    assert all(isinstance(i.kv, LazyChunkKV) for i in loaded.inputs)
    assert loaded.load_stats().layers_read > 0
    assert torch.equal(cold, warm)
    assert catalog.variants_of_chunk(refs[0].chunk_id)[0].access_count == 2
    cache.store.close()


def _damage(cache: ChunkKVCache, ref: ChunkRef, kind: str) -> None:
    key = cache.keys.key(ref.token_ids)
    disk = cache.store.tier("disk")
    path = disk.path(key)
    data = bytearray(path.read_bytes())
    if kind == "flip_last_layer":
        data[-5] ^= 0x40  # the header stays valid: found only when the last layer is read
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif kind == "missing":
        path.unlink()
    elif kind == "wrong_fingerprint":
        entry = disk.get(key)
        meta = EntryMeta(**{**vars(entry.meta), "fingerprint": "another-model"})
        disk.put(key, KVEntry(meta, entry.kv))


@pytest.mark.parametrize("kind", ["flip_last_layer", "truncate", "missing", "wrong_fingerprint"])
def test_damaged_entry_is_recomputed_with_the_same_answer(
    tiny_engine, catalog, refs, tmp_path, kind
):
    cache = make_cache(tiny_engine, catalog, tmp_path, tiers=("disk",))
    reference, _ = prefill_logits(tiny_engine, cache, refs)
    _damage(cache, refs[1], kind)
    logits, loaded = prefill_logits(tiny_engine, cache, refs)
    assert torch.equal(logits, reference)
    counters = cache.store.stats()[0].counters
    if kind == "missing":
        assert counters.misses >= 1 and loaded.computed == [refs[1].chunk_id]
    else:
        assert counters.corrupt == 1
    assert loaded.load_stats().fell_back == (kind == "flip_last_layer")
    # The entry was written again and is good now.
    fresh = cache.store.get(
        cache.keys.key(refs[1].token_ids), cache.keys.expectation(refs[1].token_ids)
    )
    assert fresh is not None and fresh.meta.fingerprint == tiny_engine.fingerprint
    assert catalog.get_variant(cache.keys.key(refs[1].token_ids)).status == READY
    again, loaded = prefill_logits(tiny_engine, cache, refs)
    assert torch.equal(again, reference) and loaded.computed == []
    cache.store.close()


def test_put_variant_and_load_it_by_context(tiny_engine, catalog, refs, tmp_path):
    cache = make_cache(tiny_engine, catalog, tmp_path)
    target, before = refs[2], (refs[0].chunk_id, refs[1].chunk_id)
    base = tiny_engine.encode_chunk(target.token_ids)
    base.kv = base.kv * 1.5  # stands for KV recomputed in a new context
    base.context = before
    stats = VariantStats(
        a=0.1,
        b=0.3,
        cci=0.58,
        inter_scores={before[0]: 0.2},
        token_scores=[0.1] * base.num_tokens,
        expected_savings=12.0,
    )
    record = cache.variants.put(target.chunk_id, base, stats)
    assert record.context == before and record.stats.cci == 0.58
    assert cache.store.usage(record.store_key).savings == 12.0
    with cache.loader.load([ChunkRef(target.chunk_id, target.token_ids, before)]) as loaded:
        source = loaded.inputs[0].kv
        assert source.context == before and loaded.computed == []
        assert torch.equal(source.layer(2), base.kv[2].half().float())
    with cache.loader.load([ChunkRef(target.chunk_id, target.token_ids, (999,))]) as loaded:
        assert loaded.inputs[0].kv.context == ()  # no such variant: the base one
        assert loaded.computed == [target.chunk_id]
    cache.store.close()


def test_evictions_and_drops_reach_the_catalog(tiny_engine, catalog, refs, tmp_path):
    size = tiny_engine.encode_chunk(refs[0].token_ids).kv.numel() * 2  # fp16 bytes
    big = max(size, *(tiny_engine.encode_chunk(r.token_ids).kv.numel() * 2 for r in refs))
    cache = make_cache(tiny_engine, catalog, tmp_path, cpu_bytes=big, disk_bytes=big)
    with cache.loader.load(refs[:3]):
        pass
    statuses = [catalog.variants_of_chunk(r.chunk_id, status=None)[0] for r in refs[:3]]
    assert [(v.status, v.tier) for v in statuses] == [
        (MISSING, "disk"),
        (READY, "disk"),
        (READY, "cpu"),
    ]
    deleted = cache.maintenance.forget_document(catalog.get_chunk(refs[0].chunk_id).document_id)
    assert len(deleted.store_keys) == 3 and cache.store.locations() == {}
    cache.store.close()


@pytest.mark.parametrize(("dtype", "codec"), [("float32", "float16"), ("bfloat16", "bfloat16")])
def test_the_service_stores_kv_in_the_codec_auto_picks_for_its_model(
    dtype, codec, smol_tokenizer, catalog, tmp_path
):
    """The default store codec (`auto`): a bfloat16 model's KV is kept in bfloat16, exact, not
    rounded into float16's narrower exponent; a float32 model's in float16, as before."""
    from app.kvcache.chunk_cache import open_chunk_cache
    from engine.engine import Engine
    from engine.model.loader import wrap_model
    from tests.app.conftest import make_settings
    from tests.conftest import build_tiny_model

    settings = make_settings(tmp_path / "data")
    model = build_tiny_model(len(smol_tokenizer)).to(getattr(torch, dtype))
    engine = Engine(settings.engine_config(), wrap_model(model, smol_tokenizer))
    service = open_chunk_cache(settings, catalog, engine)
    try:
        assert service.cache.keys.storage_dtype == codec
        assert service.cache.keys.codec(()) == codec
    finally:
        service.close()
