"""The retrieval change log: which chunks entered or left retrieval, in commit order.

Every replica keeps a local vector index and follows this log (`changes_since(cursor)`), so
an add or delete on one replica is searchable (or gone) on every other one without a
restart. Writers append inside the transaction that makes the change, after taking
`CHANGE_LOCK` (a transaction-level advisory lock on PostgreSQL; SQLite has one writer at a
time anyway). That makes `seq` order equal commit order: a follower that has applied
everything up to `seq` never finds a smaller `seq` committed later, so `seq > cursor` misses
nothing. The lock is held for a few inserts at the end of an ingest or delete, never while
KV is computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import Row, Select, delete, func, insert, select, text
from sqlalchemy.orm import Session

from app.catalog import records as rec
from app.catalog.db import BaseCatalog, rows_changed
from app.catalog.models import ADD, Chunk, Document, IndexChange, utcnow

# pg_advisory_xact_lock key of the change log ("kvmchg" in ASCII).
CHANGE_LOCK = 0x6B766D636867


def append_changes(s: Session, op: str, chunk_ids: Sequence[int]) -> None:
    """Log `op` for each chunk, in order, inside the caller's transaction (takes the lock)."""
    if not chunk_ids:
        return
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": CHANGE_LOCK})
    now = utcnow()
    s.execute(
        insert(IndexChange), [{"chunk_id": int(c), "op": op, "created_at": now} for c in chunk_ids]
    )


class ChangeLog(BaseCatalog):
    """Catalog methods of the change log and of the index rebuild (mixed into `Catalog`)."""

    def last_change_seq(self) -> int:
        """The newest committed `seq` (0: empty log). Read it before listing the indexed
        chunks, then follow from it: changes in between are applied twice, which is harmless."""
        with self.session() as s:
            return int(s.scalar(select(func.max(IndexChange.seq))) or 0)

    def changes_since(self, cursor: int, limit: int = 1000) -> list[rec.IndexChangeRecord]:
        """Up to `limit` changes with `seq > cursor`, oldest first, adds with their chunk."""
        with self.session() as s:
            rows = s.execute(
                select(IndexChange.seq, IndexChange.chunk_id, IndexChange.op)
                .where(IndexChange.seq > cursor)
                .order_by(IndexChange.seq)
                .limit(limit)
            ).all()
            added = {c.chunk_id: c for c in _indexed(s, [r.chunk_id for r in rows if r.op == ADD])}
            return [
                rec.IndexChangeRecord(seq, chunk_id, op, added.get(chunk_id) if op == ADD else None)
                for seq, chunk_id, op in rows
            ]

    def prune_changes(self, older_than: datetime) -> int:
        """Delete log entries made before `older_than`, always keeping the newest one (so `seq`
        never restarts on SQLite, which reuses the largest rowid + 1); returns how many went.
        A follower that has not polled since then must resync (`IndexFollower`)."""
        with self.session() as s:
            newest = s.scalar(select(func.max(IndexChange.seq)))
            if newest is None:
                return 0
            return rows_changed(
                s,
                delete(IndexChange).where(
                    IndexChange.created_at < older_than, IndexChange.seq < newest
                ),
            )

    def indexed_chunks_by_id(self, chunk_ids: Sequence[int]) -> list[rec.IndexedChunk]:
        """The retrievable chunks among `chunk_ids`, with their embeddings (any order)."""
        with self.session() as s:
            return [
                c
                for start in range(0, len(chunk_ids), 500)
                for c in _indexed(s, list(chunk_ids[start : start + 500]))
            ]

    def indexed_chunk_ids(self) -> list[int]:
        """Ids of every retrievable chunk (an index row assigned), ascending."""
        with self.session() as s:
            return list(
                s.scalars(
                    select(Chunk.id).where(Chunk.embedding_row.is_not(None)).order_by(Chunk.id)
                )
            )

    def indexed_chunks(self, after_id: int = 0, limit: int = 1000) -> list[rec.IndexedChunk]:
        """Retrievable chunks with id > `after_id`, ascending, with their embeddings (a page)."""
        with self.session() as s:
            query = (
                _indexed_query()
                .where(Chunk.embedding_row.is_not(None), Chunk.id > after_id)
                .order_by(Chunk.id)
                .limit(limit)
            )
            return [_indexed_record(row) for row in s.execute(query)]

    def iter_indexed_chunks(self, page: int = 1000) -> Iterable[rec.IndexedChunk]:
        """Every retrievable chunk, page by page (what a replica rebuilds its index from)."""
        after = 0
        while True:
            batch = self.indexed_chunks(after, page)
            yield from batch
            if len(batch) < page:
                return
            after = batch[-1].chunk_id


def _indexed_query() -> Select[int, str, str, str | None, bytes | None]:
    """(chunk id, document title, chunk text, embedder, embedding) of chunks, to filter."""
    return select(Chunk.id, Document.title, Chunk.text, Chunk.embedder, Chunk.embedding).join(
        Document, Document.id == Chunk.document_id
    )


def _indexed_record(row: Row[int, str, str, str | None, bytes | None]) -> rec.IndexedChunk:
    chunk_id, title, chunk_text, embedder, embedding = row
    return rec.IndexedChunk(
        chunk_id, title, chunk_text, embedder, bytes(embedding) if embedding is not None else None
    )


def _indexed(s: Session, chunk_ids: list[int]) -> list[rec.IndexedChunk]:
    if not chunk_ids:
        return []
    query = _indexed_query().where(Chunk.id.in_(chunk_ids), Chunk.embedding_row.is_not(None))
    return [_indexed_record(row) for row in s.execute(query)]
