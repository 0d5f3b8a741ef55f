"""Ingest leases: a document becomes retrievable only through an owned, live ingest row.

    begin_ingest   document + chunks (with embeddings) + ingests row (RUNNING, owner, lease)
    heartbeat      the owner renews the lease while it computes KV
    finish_ingest  the commit point: index rows, `add` entries in the change log, row deleted
    claim_ingest   any replica, once the lease has expired: RECLAIMING, itself as owner; it
                   then deletes the document (`Catalog.delete_document`)

`finish_ingest` and `claim_ingest` each decide with one conditional write to the row (a
`DELETE` / an `UPDATE` whose `WHERE` is re-checked under the row lock), so exactly one wins: an
owner that lost its lease learns it
(`LeaseLost`) and undoes its work; a claim on a row that finished changes nothing. Lease
times come from the clock of the replica that writes them: keep replicas' clocks within a
small fraction of the lease of each other (NTP does).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update

from app.catalog import records as rec
from app.catalog.changes import append_changes
from app.catalog.db import BaseCatalog, rows_changed
from app.catalog.models import (
    ADD,
    INGEST_STATES,
    RECLAIMING,
    RUNNING,
    Chunk,
    Document,
    Ingest,
    utcnow,
)
from engine.errors import KvMosaicError


class LeaseLost(KvMosaicError):
    """The ingest's row is gone or owned by someone else: it was reclaimed or deleted."""


class IngestLeases(BaseCatalog):
    """Catalog methods of ingest leases (mixed into `Catalog`)."""

    def begin_ingest(
        self,
        source: str,
        title: str,
        content_hash: str,
        chunks: Sequence[rec.NewChunk],
        owner: str,
        lease_s: float,
        embedder: str | None = None,
    ) -> rec.AddedDocument:
        """Store the document, its chunks (not retrievable yet) and a RUNNING ingest row owned
        by `owner` whose lease ends `lease_s` from now, in one transaction."""
        now = utcnow()
        with self.session() as s:
            document = Document(source=source, title=title, content_hash=content_hash)
            document.chunks = [
                Chunk(
                    ordinal=i,
                    text=c.text,
                    num_tokens=c.num_tokens,
                    token_ids_hash=c.token_ids_hash,
                    embedding=c.embedding,
                    embedder=embedder if c.embedding is not None else None,
                )
                for i, c in enumerate(chunks)
            ]
            s.add(document)
            s.flush()
            s.add(
                Ingest(
                    document_id=document.id,
                    owner=owner,
                    state=RUNNING,
                    started_at=now,
                    lease_expires_at=now + timedelta(seconds=lease_s),
                )
            )
            return rec.AddedDocument(
                rec.document_record(document, len(chunks)),
                tuple(rec.chunk_record(c) for c in document.chunks),
            )

    def heartbeat(self, document_ids: Sequence[int], owner: str, lease_s: float) -> set[int]:
        """Extend the leases `owner` still holds among `document_ids`; returns those ids."""
        if not document_ids:
            return set()
        with self.session() as s:
            held = set(
                s.scalars(
                    select(Ingest.document_id).where(
                        Ingest.document_id.in_(list(document_ids)),
                        Ingest.owner == owner,
                        Ingest.state == RUNNING,
                    )
                )
            )
            if held:
                s.execute(
                    update(Ingest)
                    .where(Ingest.document_id.in_(held), Ingest.owner == owner)
                    .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
                )
            return held

    def finish_ingest(self, document_id: int, owner: str) -> None:
        """Make the document retrievable: index rows for its chunks, their `add` entries in the
        change log, the ingest row deleted. `LeaseLost` (nothing changed) if `owner` no longer
        holds a RUNNING row for it."""
        with self.session() as s:
            # The conditional delete is the decision: it takes the row's write lock first, so a
            # concurrent claim either already changed the row (we delete nothing) or waits.
            won = (
                rows_changed(
                    s,
                    delete(Ingest).where(
                        Ingest.document_id == document_id,
                        Ingest.owner == owner,
                        Ingest.state == RUNNING,
                    ),
                )
                == 1
            )
            if not won:
                row = s.scalar(select(Ingest).where(Ingest.document_id == document_id))
                raise LeaseLost(
                    f"document {document_id}: the ingest lease was lost "
                    f"({'deleted' if row is None else f'{row.state} by {row.owner}'})"
                )
            chunk_ids = list(
                s.scalars(
                    select(Chunk.id).where(Chunk.document_id == document_id).order_by(Chunk.id)
                )
            )
            for chunk_id in chunk_ids:
                s.execute(update(Chunk).where(Chunk.id == chunk_id).values(embedding_row=chunk_id))
            append_changes(s, ADD, chunk_ids)

    def ingest_of(self, document_id: int) -> rec.IngestRecord | None:
        """The document's ingest row (None: retrievable, or no such document)."""
        with self.session() as s:
            row = s.scalar(select(Ingest).where(Ingest.document_id == document_id))
            return _record(row) if row is not None else None

    def ingests(self) -> list[rec.IngestRecord]:
        """Every ingest row, oldest first."""
        with self.session() as s:
            return [_record(r) for r in s.scalars(select(Ingest).order_by(Ingest.id))]

    def expired_ingests(self, now: datetime | None = None) -> list[rec.IngestRecord]:
        """Ingest rows whose lease ended before `now` (crash leftovers), oldest first."""
        now = now or utcnow()
        with self.session() as s:
            query = select(Ingest).where(
                Ingest.lease_expires_at < now, Ingest.state.in_(INGEST_STATES)
            )
            return [_record(r) for r in s.scalars(query.order_by(Ingest.id))]

    def claim_ingest(
        self, document_id: int, owner: str, lease_s: float, now: datetime | None = None
    ) -> bool:
        """Take over an expired ingest to delete it; False if its lease is live or it is gone."""
        now = now or utcnow()
        with self.session() as s:
            claimed = rows_changed(
                s,
                update(Ingest)
                .where(Ingest.document_id == document_id, Ingest.lease_expires_at < now)
                .values(
                    state=RECLAIMING, owner=owner, lease_expires_at=now + timedelta(seconds=lease_s)
                ),
            )
            return claimed == 1


def _record(row: Ingest) -> rec.IngestRecord:
    return rec.IngestRecord(
        row.document_id,
        row.owner,
        row.state,
        rec.aware(row.started_at),
        rec.aware(row.lease_expires_at),
    )
