"""Ingest leases and the retrieval change log, on SQLite and the real PostgreSQL."""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest

from app.catalog import ADD, RECLAIMING, REMOVE, RUNNING, LeaseLost, NewChunk
from app.catalog.models import utcnow


def _chunks(n: int, dim: int = 4) -> list[NewChunk]:
    vectors = np.eye(dim, dtype="<f4")[:n]
    return [NewChunk(f"text {i}", 2, f"{i:064d}", embedding=vectors[i].tobytes()) for i in range(n)]


def _begin(catalog, owner="a", lease_s=30.0, n=2, name="doc"):
    return catalog.begin_ingest(
        f"{name}.txt",
        name.title(),
        name.ljust(64, "0"),
        _chunks(n),
        owner,
        lease_s,
        embedder="emb-4",
    )


def test_ingest_is_invisible_until_finished(catalog):
    added = _begin(catalog)
    doc = added.document.id
    assert catalog.ingest_of(doc).state == RUNNING and catalog.ingest_of(doc).owner == "a"
    assert catalog.indexed_chunk_ids() == [] and catalog.changes_since(0) == []
    catalog.finish_ingest(doc, "a")
    ids = [c.id for c in added.chunks]
    assert catalog.ingest_of(doc) is None and catalog.indexed_chunk_ids() == ids
    changes = catalog.changes_since(0)
    assert [(c.chunk_id, c.op) for c in changes] == [(i, ADD) for i in ids]
    first = changes[0].chunk
    assert first.embedder == "emb-4" and np.frombuffer(first.embedding, "<f4").tolist() == [
        1,
        0,
        0,
        0,
    ]
    assert first.embedding_text == "Doc\ntext 0"
    assert catalog.last_change_seq() == changes[-1].seq


def test_delete_logs_removals_and_follow_from_a_cursor(catalog):
    one = _begin(catalog, name="one")
    catalog.finish_ingest(one.document.id, "a")
    cursor = catalog.last_change_seq()
    two = _begin(catalog, name="two")
    catalog.finish_ingest(two.document.id, "a")
    catalog.delete_document(one.document.id)
    later = catalog.changes_since(cursor)
    assert [(c.chunk_id, c.op) for c in later] == [(c.id, ADD) for c in two.chunks] + [
        (c.id, REMOVE) for c in one.chunks
    ]
    assert all(c.chunk is None for c in later if c.op == REMOVE)
    assert [c.chunk_id for c in catalog.iter_indexed_chunks(page=1)] == [c.id for c in two.chunks]


def test_an_add_whose_chunk_is_gone_has_no_chunk(catalog):
    added = _begin(catalog)
    catalog.finish_ingest(added.document.id, "a")
    catalog.delete_document(added.document.id)
    adds = [c for c in catalog.changes_since(0) if c.op == ADD]
    assert adds and all(c.chunk is None for c in adds)


def test_heartbeat_renews_only_the_owners_live_leases(catalog):
    mine, theirs = _begin(catalog, "a", 1.0, name="mine"), _begin(catalog, "b", 1.0, name="theirs")
    before = catalog.ingest_of(mine.document.id).lease_expires_at
    held = catalog.heartbeat([mine.document.id, theirs.document.id], "a", 60.0)
    assert held == {mine.document.id}
    assert catalog.ingest_of(mine.document.id).lease_expires_at > before + timedelta(seconds=30)
    assert catalog.ingest_of(theirs.document.id).lease_expires_at < before + timedelta(seconds=30)


def test_live_leases_are_never_claimed(catalog):
    added = _begin(catalog, lease_s=60.0)
    assert catalog.expired_ingests() == []
    assert not catalog.claim_ingest(added.document.id, "b", 30.0)
    catalog.finish_ingest(added.document.id, "a")  # the owner still holds it


def test_expired_lease_is_claimed_once_and_the_owner_learns_it(catalog):
    added = _begin(catalog, lease_s=0.0)
    doc = added.document.id
    later = utcnow() + timedelta(seconds=1)
    assert [i.document_id for i in catalog.expired_ingests(later)] == [doc]
    assert catalog.claim_ingest(doc, "b", 30.0, now=later)
    assert not catalog.claim_ingest(doc, "c", 30.0, now=later)  # b's claim is live now
    record = catalog.ingest_of(doc)
    assert (record.state, record.owner) == (RECLAIMING, "b")
    assert catalog.heartbeat([doc], "a", 30.0) == set()
    with pytest.raises(LeaseLost):
        catalog.finish_ingest(doc, "a")
    assert catalog.indexed_chunk_ids() == [] and catalog.changes_since(0) == []
    assert catalog.delete_document(doc) is not None and catalog.ingest_of(doc) is None


def test_finish_after_a_user_delete_is_lease_lost(catalog):
    added = _begin(catalog)
    catalog.delete_document(added.document.id)
    with pytest.raises(LeaseLost):
        catalog.finish_ingest(added.document.id, "a")


def test_finish_and_claim_race_has_one_winner(catalog):
    """Owner finishing while a peer claims the (just expired) lease: exactly one succeeds."""
    for round_ in range(4):
        added = _begin(catalog, lease_s=0.0, name=f"race{round_}")
        doc, later = added.document.id, utcnow() + timedelta(seconds=1)
        outcome: dict[str, object] = {}
        barrier = threading.Barrier(2)

        def finish(barrier, doc, outcome):
            barrier.wait()
            try:
                catalog.finish_ingest(doc, "a")
                outcome["finish"] = True
            except LeaseLost:
                outcome["finish"] = False

        def claim(barrier, doc, later, outcome):
            barrier.wait()
            outcome["claim"] = catalog.claim_ingest(doc, "b", 30.0, now=later)

        threads = [
            threading.Thread(target=finish, args=(barrier, doc, outcome)),
            threading.Thread(target=claim, args=(barrier, doc, later, outcome)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outcome["finish"] != outcome["claim"], outcome
        indexed = set(catalog.indexed_chunk_ids()) >= {c.id for c in added.chunks}
        assert indexed == outcome["finish"]


@pytest.mark.postgres
def test_change_seq_follows_commit_order_under_concurrent_writers(postgres_url):
    """Many threads ingesting and deleting at once: a follower polling `seq > cursor` sees every
    change exactly once, and ends with exactly the indexed chunks."""
    from app.catalog import Catalog, CatalogConfig

    catalog = Catalog.open(CatalogConfig(url=postgres_url))
    seen: dict[int, str] = {}
    cursor, stop = 0, threading.Event()

    def follow_once():
        nonlocal cursor
        for change in catalog.changes_since(cursor):
            assert change.seq > cursor
            cursor = change.seq
            if change.op == ADD:
                seen[change.chunk_id] = ADD
            else:
                seen.pop(change.chunk_id, None)

    def writer(w: int):
        for i in range(6):
            added = _begin(catalog, f"w{w}", name=f"w{w}-{i}")
            catalog.finish_ingest(added.document.id, f"w{w}")
            if i % 2:
                catalog.delete_document(added.document.id)

    def follower():
        while not stop.is_set():
            follow_once()

    try:
        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        watcher = threading.Thread(target=follower)
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        watcher.join()
        follow_once()
        assert sorted(seen) == catalog.indexed_chunk_ids()
        assert len(seen) == 4 * 3 * 2
    finally:
        catalog.close()


def test_pruning_keeps_the_newest_entry_so_seq_never_restarts(catalog):
    first = _begin(catalog, name="first")
    catalog.finish_ingest(first.document.id, "a")
    newest = catalog.last_change_seq()
    assert catalog.prune_changes(utcnow() + timedelta(seconds=5)) == len(first.chunks) - 1
    assert [c.seq for c in catalog.changes_since(0)] == [newest]
    second = _begin(catalog, name="second")
    catalog.finish_ingest(second.document.id, "a")
    assert min(c.seq for c in catalog.changes_since(newest)) > newest
    assert catalog.prune_changes(utcnow() - timedelta(hours=1)) == 0  # nothing that old
    found = catalog.indexed_chunks_by_id([c.id for c in second.chunks] + [10**9])
    assert sorted(c.chunk_id for c in found) == sorted(c.id for c in second.chunks)
