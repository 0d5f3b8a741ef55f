"""The catalog repository on SQLite and on the real PostgreSQL: CRUD, cascades, atomicity."""

from __future__ import annotations

import dataclasses
import threading
from datetime import UTC, datetime

import pytest

from app.catalog import (
    MISSING,
    READY,
    CatalogError,
    NewChunk,
    NewVariant,
    VariantStats,
    context_signature,
    parse_context_signature,
)


def _chunks(n: int, first_row: int | None = 0) -> list[NewChunk]:
    return [
        NewChunk(f"text {i}", 10 + i, f"{i:064x}", None if first_row is None else first_row + i)
        for i in range(n)
    ]


def _variant(
    chunk_id: int, key: str, context=(), tier="disk", num_bytes=1000, **stats
) -> NewVariant:
    return NewVariant(
        chunk_id,
        tuple(context),
        "fp0",
        "pd0",
        "float16",
        key,
        tier,
        num_bytes,
        10,
        VariantStats(**stats),
    )


def test_ready_bytes_by_kind_and_codec(catalog):
    chunk = catalog.add_document("a.txt", "", "a" * 64, _chunks(1)).chunks[0]
    catalog.put_variant(_variant(chunk.id, "b" * 32, num_bytes=100))
    catalog.put_variant(
        dataclasses.replace(_variant(chunk.id, "c" * 32, num_bytes=400), storage_dtype="float32")
    )
    catalog.put_variant(_variant(chunk.id, "d" * 32, context=(7,), num_bytes=30))
    catalog.put_variant(_variant(chunk.id, "e" * 32, context=(8,), num_bytes=20))
    catalog.put_variant(_variant(chunk.id, "f" * 32, context=(9,), num_bytes=1000))
    catalog.put_variant(dataclasses.replace(_variant(chunk.id, "g" * 32, num_bytes=70), lead=(3,)))
    catalog.mark_missing(["f" * 32])  # not in the store: not counted
    assert catalog.ready_bytes_by_kind() == {
        "base:float16": 100,
        "base:float32": 400,
        "context:float16": 50,
        "conditioned:float16": 70,
    }


def test_add_get_list_document(catalog):
    added = catalog.add_document("a.txt", "Alpha", "a" * 64, _chunks(3))
    assert added.document.num_chunks == 3 and added.document.title == "Alpha"
    assert [c.ordinal for c in added.chunks] == [0, 1, 2]
    assert [c.embedding_row for c in added.chunks] == [0, 1, 2]
    assert added.document.created_at.tzinfo is not None
    second = catalog.add_document("b.txt", "", "b" * 64, _chunks(1, first_row=3))
    assert catalog.get_document(added.document.id) == added.document
    assert [d.id for d in catalog.list_documents()] == [added.document.id, second.document.id]
    assert [d.id for d in catalog.list_documents(offset=1, limit=5)] == [second.document.id]
    assert catalog.find_documents_by_hash("b" * 64) == [second.document]
    assert catalog.get_document(10_000) is None
    assert catalog.chunks_of_document(added.document.id) == list(added.chunks)


def test_add_document_is_all_or_nothing(catalog):
    catalog.add_document("a.txt", "", "a" * 64, _chunks(2))
    # Row 1 is taken already: the whole document must be rejected, not half stored.
    with pytest.raises(CatalogError):
        catalog.add_document("b.txt", "", "b" * 64, _chunks(3, first_row=1))
    assert catalog.stats().num_documents == 1
    assert catalog.stats().num_chunks == 2
    assert catalog.find_documents_by_hash("b" * 64) == []


def test_chunks_by_embedding_rows_and_assignment(catalog):
    added = catalog.add_document("a.txt", "", "a" * 64, _chunks(3, first_row=None))
    ids = [c.id for c in added.chunks]
    catalog.set_embedding_rows({ids[0]: 7, ids[1]: 5, ids[2]: 6})
    found = catalog.chunks_by_embedding_rows([5, 99, 7])
    assert [c.id if c else None for c in found] == [ids[1], None, ids[0]]
    assert catalog.max_embedding_row() == 7
    with pytest.raises(CatalogError):
        catalog.set_embedding_rows({ids[0]: 5})
    assert [c.id if c else None for c in catalog.get_chunks([ids[2], 12345, ids[0]])] == [
        ids[2],
        None,
        ids[0],
    ]


def test_variants_put_refresh_access_and_stats(catalog):
    chunk = catalog.add_document("a.txt", "", "a" * 64, _chunks(2)).chunks[0]
    base = catalog.put_variant(_variant(chunk.id, "k" * 32))
    other = catalog.put_variant(
        _variant(
            chunk.id,
            "m" * 32,
            context=(9, 4),
            tier="cpu",
            num_bytes=50,
            a=0.1,
            b=0.2,
            cci=0.6,
            inter_scores={9: 0.3, 4: 0.1},
            token_scores=[0.5] * 10,
            expected_savings=8.5,
        )
    )
    assert base.context == () and base.status == READY and base.access_count == 0
    assert other.context == (
        9,
        4,
    )  # chunk ids come back as ints, from the signature and from JSON keys
    assert other.stats.inter_scores == {9: 0.3, 4: 0.1} and other.stats.token_scores == [0.5] * 10
    assert [v.store_key for v in catalog.variants_of_chunk(chunk.id)] == ["k" * 32, "m" * 32]
    assert catalog.variants_of_chunk(chunk.id, model_fingerprint="other") == []

    when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert catalog.record_access(["k" * 32, "k" * 32, "nope"], when=when) == 1
    assert catalog.record_access(["k" * 32]) == 1
    assert catalog.get_variant("k" * 32).access_count == 2

    assert catalog.mark_missing(["k" * 32]) == 1
    assert catalog.mark_missing(["k" * 32]) == 0
    assert [v.store_key for v in catalog.variants_of_chunk(chunk.id)] == ["m" * 32]
    assert [v.status for v in catalog.variants_of_chunk(chunk.id, status=None)] == [MISSING, READY]
    stats = catalog.stats()
    assert (stats.num_variants_ready, stats.num_variants_missing) == (1, 1)
    assert stats.ready_bytes_by_tier == {"cpu": 50} and stats.total_accesses == 2

    # Refreshing by store key: back to ready, access count kept, new tier.
    again = catalog.put_variant(_variant(chunk.id, "k" * 32, tier="cpu"))
    assert (
        again.id == base.id
        and again.status == READY
        and again.access_count == 2
        and again.tier == "cpu"
    )
    assert catalog.set_variant_tier("k" * 32, "disk") and not catalog.set_variant_tier("zz", "disk")
    assert catalog.update_variant_stats("k" * 32, VariantStats(cci=0.7))
    assert catalog.get_variant("k" * 32).stats.cci == 0.7
    assert catalog.variant_statuses() == {"k" * 32: READY, "m" * 32: READY}
    assert catalog.delete_variants(["m" * 32]) == 1 and catalog.get_variant("m" * 32) is None


def test_delete_document_cascades(catalog):
    keep = catalog.add_document("keep.txt", "", "k" * 64, _chunks(1, first_row=10))
    gone = catalog.add_document("gone.txt", "", "g" * 64, _chunks(2))
    catalog.put_variant(_variant(gone.chunks[0].id, "a" * 32))
    catalog.put_variant(_variant(gone.chunks[1].id, "b" * 32))
    catalog.put_variant(_variant(keep.chunks[0].id, "c" * 32))
    deleted = catalog.delete_document(gone.document.id)
    assert deleted.num_chunks == 2 and sorted(deleted.store_keys) == ["a" * 32, "b" * 32]
    assert catalog.get_document(gone.document.id) is None
    assert catalog.get_chunk(gone.chunks[0].id) is None
    assert catalog.variant_statuses() == {"c" * 32: READY}
    assert catalog.delete_document(gone.document.id) is None


def test_variant_of_a_missing_chunk_is_rejected(catalog):
    with pytest.raises(CatalogError):
        catalog.put_variant(_variant(424242, "x" * 32))
    assert catalog.stats().num_variants_ready == 0


def test_concurrent_writers_do_not_lose_accesses(catalog):
    chunk = catalog.add_document("a.txt", "", "a" * 64, _chunks(1)).chunks[0]
    catalog.put_variant(_variant(chunk.id, "k" * 32))
    errors = []

    def work():
        try:
            for _ in range(10):
                catalog.record_access(["k" * 32])
                catalog.put_variant(_variant(chunk.id, "k" * 32))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert catalog.get_variant("k" * 32).access_count == 40


def test_context_signature_round_trip():
    assert context_signature([]) == "" and parse_context_signature("") == ()
    assert context_signature([12, 7, 3]) == "12,7,3"
    assert parse_context_signature(context_signature([12, 7, 3])) == (
        12,
        7,
        3,
    )  # ids come back as ints
    with pytest.raises(ValueError):  # a chunk id is an int; text that is not one has no signature
        context_signature(["a,b"])


def test_a_conditioned_base_keeps_its_lead_and_stays_out_of_the_prefix_tree(catalog):
    """The lead comes back in order; `variant_contexts` (what the prefix tree of exact paths is
    built from) leaves a conditioned base out, whatever its context."""
    chunk = catalog.add_document("a.txt", "", "a" * 64, _chunks(1)).chunks[0]
    catalog.put_variant(_variant(chunk.id, "b" * 32))
    conditioned = catalog.put_variant(
        dataclasses.replace(_variant(chunk.id, "c" * 32), lead=(7, 3))
    )
    assert conditioned.lead == (7, 3) and conditioned.is_conditioned
    assert [v.lead for v in catalog.variants_of_chunk(chunk.id)] == [(), (7, 3)]
    assert [v.store_key for v in catalog.variant_contexts("fp0", "pd0")] == ["b" * 32]
