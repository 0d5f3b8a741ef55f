"""Start-up reconciliation after a simulated crash, on SQLite and PostgreSQL.

The "crash" is a process that stops between steps: the store and the catalog objects are
dropped without closing, and a new store over the same disk directory plays the restart.
"""

from __future__ import annotations

import hashlib

from app.catalog import MISSING, READY, NewChunk
from app.kvcache.cache import ChunkKVCache
from app.kvcache.variants import ChunkRef
from app.store import StoreConfig, create_store, entry_from_chunk
from tests.engine.helpers import PASSAGES


def _restartable(tiny_engine, catalog, disk_dir):
    config = StoreConfig(tiers=("cpu", "disk"), disk_dir=disk_dir, disk_fsync=False)
    return lambda: ChunkKVCache.open(tiny_engine, create_store(config), catalog)


def test_reconcile_after_crash(tiny_engine, catalog, tmp_path):
    ids = [tiny_engine.chunk_ids(text, title) for title, text in PASSAGES]
    added = catalog.add_document(
        "p",
        "",
        "0" * 64,
        [
            NewChunk(t, len(i), hashlib.sha256(repr(i).encode()).hexdigest())
            for (_, t), i in zip(PASSAGES, ids)
        ],
    )
    refs = [ChunkRef(c.id, i) for c, i in zip(added.chunks, ids)]
    start = _restartable(tiny_engine, catalog, tmp_path / "kv")
    cache = start()
    keys = [cache.keys.key(r.token_ids) for r in refs]

    # chunk 0: stored and recorded, then its file is lost (disk wiped by hand)
    # chunk 1: recorded in the cpu tier only (gone at restart), its KV also on disk
    # chunk 2: KV written, crash before the catalog row
    # chunk 3: recorded ready in the cpu tier, never demoted: lost at restart
    with cache.loader.load([refs[0], refs[1], refs[3]]):
        pass
    cache.store.put(keys[1], cache.store.tier("cpu").get(keys[1]), tier="disk")
    entry = entry_from_chunk(tiny_engine.encode_chunk(refs[2].token_ids), "float16")
    cache.store.put(keys[2], entry, tier="disk")
    cache.store.put(keys[0], cache.store.tier("cpu").get(keys[0]), tier="disk")
    cache.store.tier("disk").path(keys[0]).unlink()
    orphan_in_stale_row = keys[3]
    assert catalog.get_variant(keys[2]) is None

    restarted = start()  # the crash: the old store's RAM is gone, the disk files stay
    report = restarted.maintenance.reconcile()
    assert report.orphans_removed == 1 and not restarted.store.contains(keys[2])
    found = catalog.get_variant(keys[1])
    assert (found.status, found.tier) == (READY, "disk")
    assert report.marked_ready == 1
    if catalog.is_shared:  # PostgreSQL: local tiers may be a live peer's, never judged from here
        assert report.marked_missing == 0
        assert catalog.get_variant(keys[0]).status == catalog.get_variant(keys[3]).status == READY
        catalog.mark_missing([keys[0]])  # what an explicit eviction would record
    else:
        assert report.marked_missing == 2
        assert catalog.get_variant(keys[0]).status == MISSING
        assert catalog.get_variant(orphan_in_stale_row).status == MISSING
    assert restarted.maintenance.reconcile() == type(report)(
        0, 0, 0
    )  # a second pass has nothing to do

    # A missing variant comes back when it is computed again.
    with restarted.loader.load([refs[0]]) as loaded:
        assert loaded.computed == [refs[0].chunk_id]
    assert catalog.get_variant(keys[0]).status == READY
    restarted.store.close()


def test_orphans_wait_out_the_grace_period(tiny_engine, catalog, tmp_path):
    """KV with no catalog row (a peer between its KV write and its catalog row) survives until
    it has been an orphan for the whole grace period; one that gains a row is kept."""
    config = StoreConfig(tiers=("cpu", "disk"), disk_dir=tmp_path / "kv", disk_fsync=False)
    cache = ChunkKVCache.open(tiny_engine, create_store(config), catalog)
    ids = [tiny_engine.chunk_ids(text, title) for title, text in PASSAGES[:2]]
    added = catalog.add_document("p", "", "1" * 64, [NewChunk("t", len(i), "2" * 64) for i in ids])
    keys = [cache.keys.key(i) for i in ids]
    for key, token_ids in zip(keys, ids):
        cache.store.put(
            key, entry_from_chunk(tiny_engine.encode_chunk(token_ids), "float16"), tier="disk"
        )
    assert cache.maintenance.reconcile(orphan_grace_s=3600).orphans_removed == 0
    assert cache.maintenance.sweep_orphans(3600) == 0 and all(cache.store.contains(k) for k in keys)
    # the peer finishes chunk 0: its row arrives; chunk 1's writer died
    cache.variants.put(added.chunks[0].id, tiny_engine.encode_chunk(ids[0]))
    assert cache.maintenance.sweep_orphans(0.0) == 1
    assert cache.store.contains(keys[0]) and not cache.store.contains(keys[1])
    cache.store.close()
