"""The prefix tree of chunk sequences over a real catalog and store (tiny engine): what a
request leaves joins it, evictions and deletions leave it, a replica or a restart rebuilds it
from the catalog, a change during a rebuild survives it, and a stale node costs a miss only."""

from __future__ import annotations

import hashlib

import pytest
import torch

from app.catalog import Catalog, CatalogConfig, NewChunk
from app.kvcache.cache import ChunkKVCache
from app.kvcache.chunk_cache import ServiceChunkCache
from app.kvcache.chunk_tree import ChunkTreeIndex
from app.kvcache.variants import ChunkRef
from app.store import StoreConfig, create_store
from app.variants.order import ChunkOrder
from app.variants.served import served_tokens
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import PASSAGES, QUESTION


@pytest.fixture
def catalog(tmp_path):
    catalog = Catalog.open(CatalogConfig(data_dir=tmp_path))
    yield catalog
    catalog.close()


@pytest.fixture
def refs(tiny_engine, catalog) -> list[ChunkRef]:
    ids = [tiny_engine.chunk_ids(text, title) for title, text in PASSAGES[:3]]
    new = [
        NewChunk(text, len(i), hashlib.sha256(repr(i).encode()).hexdigest())
        for (_, text), i in zip(PASSAGES, ids)
    ]
    added = catalog.add_document("passages", "Passages", "0" * 64, new)
    return [ChunkRef(c.id, i) for c, i in zip(added.chunks, ids)]


def make_cache(engine, catalog, kv_dir) -> ChunkKVCache:
    """KV stored in float32, as the tiny engine computes it: exact reuse is the reference's
    to 1e-4."""
    config = StoreConfig(tiers=("cpu", "disk"), disk_dir=kv_dir, disk_fsync=False, codec="float32")
    return ChunkKVCache.open(engine, create_store(config), catalog, storage_dtype=config.codec)


def ask(engine, cache: ChunkKVCache, refs: list[ChunkRef], mode: str = "prefix"):
    """One request in the given chunk order: choose, load, prefill, keep what it leaves."""
    chosen = cache.variants.choose(Mode.named(mode), [(r.chunk_id, r.token_ids) for r in refs])
    with cache.loader.load(chosen) as loaded:
        result = engine.prefill(loaded.inputs, QUESTION, mode=Mode.named(mode))
    cache.variants.harvest(result, loaded.inputs)
    return result, loaded.inputs


def ids(refs) -> list[int]:
    return [r.chunk_id for r in refs]


def test_a_request_s_harvest_joins_the_tree_and_the_cache_aware_order_reuses_it(
    tiny_engine, catalog, refs, tmp_path
):
    cache = make_cache(tiny_engine, catalog, tmp_path / "kv")
    a, b, c = ids(refs)
    # a, b, c: bases computed now, then (a, b) and (a, b, c) harvested
    ask(tiny_engine, cache, refs)
    assert cache.tree.holds((a, b, c))
    shuffled = [c, a, b]
    # only c, from its base at the head
    assert cache.tree.order(shuffled, ChunkOrder.RETRIEVAL).exact == 1
    ordering = cache.tree.order(shuffled, ChunkOrder.CACHE_AWARE)
    assert ordering.order == (a, b, c) and ordering.exact == 3
    by_id = {r.chunk_id: r for r in refs}
    result, inputs = ask(tiny_engine, cache, [by_id[i] for i in ordering.order])
    served = served_tokens(result, inputs, tiny_engine.loaded.spec.num_layers)
    assert served.exact_chunks == (True, True, True) and served.blended == served.computed == 0
    full = tiny_engine.prefill(
        [ChunkInput(r.chunk_id, r.token_ids) for r in refs], QUESTION, mode=Mode.named("full")
    )
    torch.testing.assert_close(
        result.logits, full.logits, rtol=1e-4, atol=1e-4
    )  # exact reuse: full's answer


def test_a_replica_or_a_restart_rebuilds_the_tree_from_the_catalog(
    tiny_engine, catalog, refs, tmp_path
):
    first = make_cache(tiny_engine, catalog, tmp_path / "kv-a")
    ask(tiny_engine, first, refs)
    peer = make_cache(tiny_engine, catalog, tmp_path / "kv-b")  # its own store, the shared catalog
    assert len(peer.tree) == 0
    assert peer.tree.rebuild() == len(first.tree) == 5  # three bases, two harvested variants
    assert peer.tree.holds(tuple(ids(refs)))


def test_evictions_deletions_and_prunes_leave_the_tree(tiny_engine, catalog, refs, tmp_path):
    cache = make_cache(tiny_engine, catalog, tmp_path / "kv")
    a, b, c = ids(refs)
    ask(tiny_engine, cache, refs)
    service = ServiceChunkCache(cache)
    try:
        service.evict(None, b, None, None)  # every variant of b: its base and (a, b)
        assert not cache.tree.holds((a, b)) and cache.tree.holds((a,))
        assert cache.tree.order([c, a, b], ChunkOrder.CACHE_AWARE).order == (
            c,
            a,
            b,
        )  # bases only: retrieval order
        assert cache.tree.rebuild() == len(cache.tree)  # the catalog agrees: those rows are missing
        (key,) = [v.store_key for v in catalog.variants_of_chunk(a)]
        cache.tree.entry_dropped(key)  # the store dropped a's base from its last tier
        assert not cache.tree.holds((a,))
        service.forget_document(catalog.get_chunk(c).document_id)
        assert len(cache.tree) == 0
    finally:
        service.close()


def test_variants_pruned_beyond_the_limit_leave_the_tree(tiny_loaded, catalog, refs, tmp_path):
    from engine import EngineConfig
    from engine.engine import Engine

    engine = Engine(
        EngineConfig(
            data_dir=tmp_path / "engine",
            fidelity="fast",
            encode_dtype="engine",
            craft_max_variants=2,
        ),
        tiny_loaded,
    )
    cache = make_cache(engine, catalog, tmp_path / "kv")
    a, b, c = refs
    ask(engine, cache, [a, b, c])
    ask(engine, cache, [b, a, c])  # c now has three variants (base, after a b, after b a): one goes
    assert len(catalog.variants_of_chunk(c.chunk_id)) == 2
    assert (
        len(cache.tree) == ChunkTreeIndex(catalog, cache.keys).rebuild()
    )  # the catalog's rows, no more


def test_a_stale_node_costs_a_miss_never_a_wrong_kv(tiny_engine, catalog, refs, tmp_path):
    cache = make_cache(tiny_engine, catalog, tmp_path / "kv")
    a, b, c = ids(refs)
    ask(tiny_engine, cache, refs)
    cache.tree.stored(
        "no-such-key", b, (c,), cache.keys.codec((c,))
    )  # a peer's variant, evicted since
    cache.tree.stored("no-such-key-2", c, (), cache.keys.codec())
    ordering = cache.tree.order([c, b, a], ChunkOrder.CACHE_AWARE)
    assert ordering.order[:2] == (a, b)  # the real path is longer; make the stale one win:
    cache.tree.removed([v.store_key for v in catalog.variants_of_chunk(b) if v.context])
    ordering = cache.tree.order([c, b, a], ChunkOrder.CACHE_AWARE)
    assert ordering.order == (c, b, a) and ordering.exact == 2
    by_id = {r.chunk_id: r for r in refs}
    result, inputs = ask(tiny_engine, cache, [by_id[i] for i in ordering.order])
    served = served_tokens(result, inputs, tiny_engine.loaded.spec.num_layers)
    assert served.exact_chunks == (
        True,
        False,
        False,
    )  # b fell back to its base: computed by prefix
    full = tiny_engine.prefill(
        [ChunkInput(r.chunk_id, r.token_ids) for r in [by_id[i] for i in ordering.order]],
        QUESTION,
        mode=Mode.named("full"),
    )
    torch.testing.assert_close(result.logits, full.logits, rtol=1e-4, atol=1e-4)


class SharedCatalog:
    """The catalog as replicas on one PostgreSQL see it (`is_shared`)."""

    is_shared = True

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def variant_contexts(self, fingerprint: str, prefix_digest: str):
        return self.catalog.variant_contexts(fingerprint, prefix_digest)


def test_on_a_shared_catalog_a_peer_s_local_kv_is_out_of_reach(
    tiny_engine, catalog, refs, tmp_path
):
    first = make_cache(tiny_engine, catalog, tmp_path / "kv-a")
    ask(tiny_engine, first, refs)  # everything in first's own cpu tier
    peer = make_cache(tiny_engine, catalog, tmp_path / "kv-b")
    peer.tree.catalog = SharedCatalog(catalog)
    assert peer.tree.rebuild() == 0  # the rows name a tier it has, but its own copy holds none
    a, b, c = refs
    ask(tiny_engine, peer, [c])  # c's base, computed and stored by the peer itself
    assert peer.tree.rebuild() == 1 and peer.tree.holds((c.chunk_id,))
    peer.store.tier("disk").shared = True  # as if its disk tier were the one both replicas read
    (key,) = [v.store_key for v in catalog.variants_of_chunk(a.chunk_id)]
    catalog.set_variant_tier(key, "disk")
    assert peer.tree.rebuild() == 2 and peer.tree.holds((a.chunk_id,))


class ReadingCatalog:
    """A catalog whose variant read lets a local change happen halfway (as another thread would)."""

    def __init__(self, catalog: Catalog, during):
        self.catalog, self.during = catalog, during

    def variant_contexts(self, fingerprint: str, prefix_digest: str):
        rows = self.catalog.variant_contexts(fingerprint, prefix_digest)
        self.during()
        return rows


def test_changes_made_while_a_rebuild_reads_the_catalog_survive_it(
    tiny_engine, catalog, refs, tmp_path
):
    cache = make_cache(tiny_engine, catalog, tmp_path / "kv")
    a, b, c = ids(refs)
    ask(tiny_engine, cache, refs)
    index = ChunkTreeIndex(catalog, cache.keys)
    index.rebuild()
    harvested = [v.store_key for v in catalog.variants_of_chunk(c) if v.context]

    def during():
        index.stored("added-meanwhile", a, (c,), cache.keys.codec((c,)))
        index.removed(harvested)  # deleted after the catalog was read

    index.catalog = ReadingCatalog(catalog, during)
    index.rebuild()
    assert index.holds((c, a)) and index.holds((a, b)) and not index.holds((a, b, c))


def test_only_variants_the_loader_reads_join_the_tree(tiny_engine, catalog, refs, tmp_path):
    cache = make_cache(tiny_engine, catalog, tmp_path / "kv")
    a = refs[0].chunk_id
    cache.tree.stored("int4-copy", a, (), "int4")  # another codec than this replica's bases
    assert not cache.tree.holds((a,))
