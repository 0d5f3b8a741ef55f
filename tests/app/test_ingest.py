"""Ingest is idempotent and all-or-nothing; the index is rebuilt from the catalog when stale."""

from __future__ import annotations

import pytest

from app.catalog import NewChunk
from app.ingest import iter_chunk_texts
from retrieval import Retriever, SourceDocument
from retrieval.index import MANIFEST_FILE
from tests.app.conftest import DOCS, start_services

LONG = SourceDocument(
    "test:long",
    "A long note",
    " ".join(f"Sentence {i} is about tides and mills." for i in range(30)),
)


@pytest.fixture
def fresh(tiny_loaded, embedder, tmp_path):
    services = start_services(tiny_loaded, embedder, tmp_path, docs=DOCS[:2])
    yield services
    services.close()


def totals(services):
    stats = services.catalog.stats()
    entries = sum(s["entries"] for s in services.chunk_cache.tier_stats().values())
    return (
        stats.num_documents,
        stats.num_chunks,
        stats.num_variants_ready,
        len(services.retriever),
        entries,
    )


def test_ingesting_twice_adds_nothing(fresh):
    before = totals(fresh)
    results = [fresh.ingestor.ingest(doc) for doc in DOCS[:2]]
    assert [r.created for r in results] == [False, False] and totals(fresh) == before


def test_every_chunk_gets_base_kv_and_an_index_row(fresh):
    result = fresh.ingestor.ingest(LONG)
    chunks = fresh.catalog.chunks_of_document(result.document.id)
    assert len(chunks) > 3 and all(c.embedding_row == c.id for c in chunks)
    assert set(c.id for c in chunks) <= set(fresh.retriever.index.ids())
    for chunk in chunks:
        (variant,) = fresh.catalog.variants_of_chunk(chunk.id)
        assert variant.context == () and fresh.chunk_cache.store.contains(variant.store_key)


def test_a_failure_midway_leaves_no_trace(fresh, monkeypatch):
    before = totals(fresh)
    calls = []
    real = fresh.chunk_cache.store_base

    def failing(chunk_id, kv):
        calls.append(chunk_id)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return real(chunk_id, kv)

    monkeypatch.setattr(fresh.chunk_cache, "store_base", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        fresh.ingestor.ingest(LONG)
    assert totals(fresh) == before
    monkeypatch.undo()
    assert fresh.ingestor.ingest(LONG).created is True  # nothing half-there blocks a retry


def test_ingest_encodes_chunks_in_packed_batches_with_progress(fresh, monkeypatch):
    encoded, progress = [], []
    real = fresh.engine.encode_chunks

    def counting(chunks, batch_tokens):
        encoded.append(len(chunks))
        return real(chunks, batch_tokens)

    monkeypatch.setattr(fresh.engine, "encode_chunks", counting)
    fresh.chunk_cache.batch_tokens = 100  # chunks of ~47 tokens: two per pass
    result = fresh.ingestor.ingest(LONG, lambda chunks, tokens: progress.append((chunks, tokens)))
    chunks = fresh.catalog.chunks_of_document(result.document.id)
    assert 1 < len(encoded) < len(chunks) and sum(encoded) == len(chunks)
    assert [c for c, _ in progress] == encoded and sum(t for _, t in progress) == result.num_tokens
    assert result.kv == "eager" and result.kv_tiers == {"disk": len(chunks)}


def test_lazy_ingest_indexes_now_and_computes_kv_on_first_retrieval(fresh):
    from app.kvcache.chunk_cache import COMPUTED_NOW

    result = fresh.ingestor.ingest(LONG, kv="lazy")
    chunks = fresh.catalog.chunks_of_document(result.document.id)
    assert result.kv == "lazy" and result.kv_tiers == {} and result.created
    assert set(c.id for c in chunks) <= set(fresh.retriever.index.ids())
    assert all(fresh.catalog.variants_of_chunk(c.id) == [] for c in chunks)
    hits = [
        h
        for h in fresh.retriever.search("Sentence 3 is about tides and mills.", 3)
        if h.chunk_id in {c.id for c in chunks}
    ]
    assert hits
    first = fresh.rag.ask(
        fresh.rag.query("What is sentence 3 about?", mode="cacheblend", max_tokens=2)
    )
    assert COMPUTED_NOW in first.variants
    stored = [c for c in chunks if fresh.catalog.variants_of_chunk(c.id)]
    assert stored and all(
        fresh.chunk_cache.store.where(fresh.catalog.variants_of_chunk(c.id)[0].store_key) == "disk"
        for c in stored
    )
    again = fresh.rag.ask(
        fresh.rag.query("What is sentence 3 about?", mode="cacheblend", max_tokens=2)
    )
    assert COMPUTED_NOW not in again.variants


def test_unknown_kv_mode_is_refused_before_anything_is_written(fresh):
    from engine.errors import InvalidRequest

    before = totals(fresh)
    with pytest.raises(InvalidRequest, match="eager, lazy"):
        fresh.ingestor.ingest(LONG, kv="later")
    assert totals(fresh) == before


def test_only_ingests_whose_lease_expired_are_removed(fresh):
    """A crashed owner's ingest (lease expired) is removed; a live one, here or on a peer, never."""
    chunk = [NewChunk("orphan text", 3, "1" * 64)]
    crashed = fresh.catalog.begin_ingest(
        "crash", "Crashed", "0" * 64, chunk, "dead-peer", lease_s=0.0
    )
    live = fresh.catalog.begin_ingest("live", "Live", "2" * 64, chunk, "live-peer", lease_s=3600.0)
    assert fresh.ingestor.reclaim_expired() == 1
    assert fresh.catalog.get_document(crashed.document.id) is None
    assert fresh.catalog.get_document(live.document.id) is not None
    assert fresh.catalog.ingest_of(live.document.id).owner == "live-peer"


def test_a_document_ingested_elsewhere_becomes_searchable_here(
    fresh, tiny_loaded, embedder, tmp_path
):
    """A second process on the same catalog (here: another Services on the SQLite file) adds
    a document; this one's follower picks it up from the change log without a restart."""
    from app.replica import IndexFollower

    other = start_services(tiny_loaded, embedder, fresh.settings.data_dir, docs=[], index_poll_s=0)
    try:
        added = other.ingestor.ingest(LONG)
        chunk_ids = {c.id for c in other.catalog.chunks_of_document(added.document.id)}
        assert not chunk_ids & set(fresh.retriever.index.ids())
        # this replica's own earlier changes may still be after its cursor (its daemon polls on
        # its own schedule) and are applied again harmlessly: at least the new chunks count
        assert IndexFollower(fresh.catalog, fresh.retriever).poll() >= len(chunk_ids)
        assert chunk_ids <= set(fresh.retriever.index.ids())
        other.ingestor.delete(added.document.id)
        IndexFollower(fresh.catalog, fresh.retriever).poll()
        assert not chunk_ids & set(fresh.retriever.index.ids())
    finally:
        other.close()


@pytest.mark.parametrize("damage", ["delete", "stale"])
def test_missing_or_stale_index_is_rebuilt_from_the_catalog(fresh, damage):
    directory = fresh.settings.index_dir
    expected = sorted(fresh.retriever.index.ids())
    if damage == "delete":
        for path in directory.iterdir():
            path.unlink()
    else:
        fresh.retriever.index.remove(expected[:1])
        fresh.retriever.save()
    ids = [i for i, _ in iter_chunk_texts(fresh.catalog)]
    reopened = Retriever.open(
        fresh.retriever.embedder, directory, ids, lambda: iter_chunk_texts(fresh.catalog)
    )
    assert sorted(reopened.index.ids()) == expected and (directory / MANIFEST_FILE).exists()
    hit = reopened.search("When was the lighthouse first lit?", 1)[0]
    assert fresh.catalog.get_chunk(hit.chunk_id).text.startswith("The Hollin Point Lighthouse")


def test_restart_reuses_the_saved_index_and_kv(fresh, tiny_loaded, embedder):
    data_dir, before = fresh.settings.data_dir, totals(fresh)
    fresh.close()
    again = start_services(tiny_loaded, embedder, data_dir, docs=DOCS[:2])
    try:
        assert totals(again) == before
    finally:
        again.close()
    fresh.close = lambda: None  # already closed


def test_an_ingest_whose_lease_a_peer_took_is_undone_and_answered_503(fresh, monkeypatch):
    """This replica stalls past its lease, a peer claims the ingest: nothing of it stays, and
    `POST /documents` says to send it again (503), not 500."""
    from datetime import timedelta

    from fastapi.testclient import TestClient

    from app.catalog.models import utcnow
    from app.main import create_app

    before = totals(fresh)
    real = fresh.ingestor.leases.hold

    def stalled(document_id):  # the ingest begins, then this replica stalls past its lease
        real(document_id)
        assert fresh.catalog.claim_ingest(
            document_id, "peer", 30.0, now=utcnow() + timedelta(hours=1)
        )

    monkeypatch.setattr(fresh.ingestor.leases, "hold", stalled)
    with TestClient(create_app(services=fresh), client=("127.0.0.1", 50000)) as client:
        response = client.post("/documents", json={"title": LONG.title, "text": LONG.text})
    assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
    assert "send it again" in response.json()["error"]["message"]
    assert totals(fresh) == before and fresh.catalog.ingests() == []


def test_a_lease_released_while_it_was_renewed_is_not_reported_lost(caplog):
    """An ingest that finishes during a heartbeat (its row deleted, then released) lost nothing;
    one still held whose row is gone did, and only it is warned about."""
    from app.replica import LeaseKeeper

    class Catalog:
        def heartbeat(self, document_ids, owner, lease_s):
            keeper.release(1)  # document 1's ingest finished while the heartbeat ran
            return set()  # neither row is there to renew

    keeper = LeaseKeeper(Catalog(), "me", lease_s=3600.0)  # its own beat never comes in this test
    try:
        keeper.hold(1)
        keeper.hold(2)
        with caplog.at_level("WARNING", logger="app.replica"):
            assert keeper.renew() == {2}
    finally:
        keeper.close()
    lost = [r.getMessage() for r in caplog.records if "was lost" in r.getMessage()]
    assert lost == ["the ingest lease of document 2 was lost; its ingest will fail"]


def test_a_renewal_waits_for_a_commit_and_never_reports_a_finished_ingest_lost(caplog):
    """The ingest's commit deletes its lease row, but it releases the lease only after updating
    and saving the index: a renewal in that window must not find the row gone and warn."""
    import threading

    from app.replica import LeaseKeeper

    rows = {1}
    renewed = threading.Event()

    class Catalog:
        def heartbeat(self, document_ids, owner, lease_s):
            renewed.set()
            return rows & set(document_ids)

    keeper = LeaseKeeper(Catalog(), "me", lease_s=3600.0)  # its own beat never comes in this test
    try:
        keeper.hold(1)
        with caplog.at_level("WARNING", logger="app.replica"):
            with keeper.committing(1):
                rows.discard(1)  # finish_ingest: the row is gone, the ingest still holds its lease
                renewal = threading.Thread(target=lambda: keeper.renew())
                renewal.start()
                assert not renewed.wait(0.2)  # the renewal waits for the commit
            renewal.join(10)
            assert renewed.is_set()
            assert keeper.renew() == set()
    finally:
        keeper.close()
    assert not [r for r in caplog.records if "was lost" in r.getMessage()]


def test_a_follower_that_missed_the_log_resyncs_with_the_catalog(fresh):
    """After a long gap (entries may have been pruned) the follower compares instead of
    replaying."""
    from app.replica import CHANGE_LOG_KEEP_S, IndexFollower

    follower = IndexFollower(fresh.catalog, fresh.retriever)
    expected = sorted(fresh.catalog.indexed_chunk_ids())
    fresh.retriever.index.remove(expected[:1])  # a row it missed
    fresh.retriever.add([10**9], fresh.retriever.embed(["a chunk deleted while it was away"]))
    follower._last_poll -= CHANGE_LOG_KEEP_S  # the catalog was out of reach for a day
    assert follower.poll() == 2
    assert sorted(fresh.retriever.index.ids()) == expected
    assert fresh.retriever.cursor == fresh.catalog.last_change_seq()


def test_a_follower_that_read_an_add_before_a_delete_does_not_bring_the_chunk_back(fresh):
    """The follower reads a page of changes, then applies it; a delete that ran in between used
    to be undone by the page's stale add (flaky `test_add_list_show_and_delete`). Now the
    delete waits for the page (`Retriever.updating`), and the follower finds the rows gone."""
    import threading

    from app.replica import IndexFollower

    before = fresh.retriever.cursor = fresh.catalog.last_change_seq()
    added = fresh.ingestor.ingest(LONG)
    chunk_ids = {c.id for c in fresh.catalog.chunks_of_document(added.document.id)}
    assert fresh.catalog.last_change_seq() > before  # the ingest's adds follow the cursor
    follower, read, go = (
        IndexFollower(fresh.catalog, fresh.retriever),
        threading.Event(),
        threading.Event(),
    )
    updates = follower._updates

    def slow_updates(changes):
        out = updates(changes)  # vectors of the adds, read while the chunks still exist
        read.set()
        go.wait(10)
        return out

    follower._updates = slow_updates  # type: ignore[method-assign]
    polling = threading.Thread(target=follower.poll)
    polling.start()
    assert read.wait(10)
    deleting = threading.Thread(target=fresh.ingestor.delete, args=(added.document.id,))
    deleting.start()
    deleting.join(0.5)
    assert deleting.is_alive()  # it waits for the page under way
    go.set()
    polling.join(10)
    deleting.join(10)
    assert not chunk_ids & set(fresh.retriever.index.ids())
