"""`Catalog`: the repository API over documents, chunks and variants.

Every method runs in its own transaction and returns plain records (`records.py`), so the
caller never holds a session. Multi-row writes are all-or-nothing: `add_document` stores
the document and every chunk, or nothing. Integrity problems (a duplicate embedding row, a
variant for a deleted chunk) raise `CatalogError` after the transaction is rolled back; a
write the database refused (no space, a read-only volume) raises `CatalogUnwritable` and
leaves the catalog degraded (`write_error`) until a write works again (`recheck_writes`
tries one). A SQLite catalog whose volume is full at start-up opens read-only (`open`).

    catalog = Catalog.open(CatalogConfig(data_dir=Path("data")))   # migrates to head
    added = catalog.add_document("a.txt", "Title", sha, [NewChunk(text, n, ids_hash)])
    catalog.variants_of_chunk(added.chunks[0].id, model_fingerprint=fp)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Literal, TypeVar

from sqlalchemy import Engine, Select, case, delete, exists, func, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import InstrumentedAttribute, Session

from app.catalog import records as rec
from app.catalog.changes import ChangeLog, append_changes
from app.catalog.db import (
    CatalogConfig,
    create_db_engine,
    create_session_factory,
    probe_write,
    read_only_engine,
    rows_changed,
    sqlite_file,
    wrote,
)
from app.catalog.faults import (
    CatalogError,
    CatalogUnwritable,
    WriteHealth,
    free_bytes,
    unwritable_reason,
)
from app.catalog.ingests import IngestLeases
from app.catalog.models import (
    MISSING,
    READY,
    REMOVE,
    Base,
    Chunk,
    Document,
    Ingest,
    Variant,
    utcnow,
)
from engine.variant_stats import VariantStats

log = logging.getLogger(__name__)

# A catalog opened read-only tries to reopen read-write before a transaction when its volume
# has more free space than at the last try, else at most this often: the first write after
# space is freed works, not only after the daemon's retry.
REOPEN_EVERY_S = 1.0

# A document's state for listings: its ingest finished, or it is still under an ingest row.
DocumentState = Literal["ready", "ingesting"]

# Bound parameters per IN (...) clause; SQLite allows 32766, PostgreSQL 65535.
_IN_BATCH = 500

Item = TypeVar("Item")
Model = TypeVar("Model", bound=Base)
Key = TypeVar("Key", bound=Hashable)


class Catalog(IngestLeases, ChangeLog):
    """Thread-safe: each call takes its own pooled connection and transaction.

    Ingest leases (`begin_ingest`, `heartbeat`, `finish_ingest`, `claim_ingest`, ...) live in
    `ingests.py`; the retrieval change log (`changes_since`, `iter_indexed_chunks`, ...) in
    `changes.py`.
    """

    def __init__(
        self, engine: Engine, read_only: str | None = None, writable_url: str | None = None
    ):
        """`read_only`: why `engine` is a read-only fallback (None: it is not); `writable_url`:
        the database to reopen read-write once it can write (`recheck_writes`)."""
        self.writes = WriteHealth("catalog")
        self.read_only = read_only
        self._writable_url = writable_url
        self._rechecking = threading.Lock()
        self._reopen_tried, self._reopen_free = float("-inf"), 0
        self._use(engine)
        if read_only is not None:
            self.writes.failed(read_only, counted=False)

    def _use(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = create_session_factory(engine)
        file = sqlite_file(engine.url)
        self._volume = file.parent if file is not None else None

    @classmethod
    def open(cls, config: CatalogConfig) -> Catalog:
        """Connect to `config`'s database, migrating it to head first if `config.migrate`, and
        try one small write, so a catalog that cannot write is degraded from the start.

        A SQLite file that cannot be opened for want of space (SQLite cannot even read a WAL
        database then: its shared-memory file cannot grow) opens read-only and degraded, if
        it was closed cleanly and is at head; `recheck_writes` reopens it once it can write."""
        from app.catalog.migrate import at_head, upgrade_to_head

        url = config.resolved_url()
        try:
            if config.migrate:
                upgrade_to_head(url)
            catalog = cls(create_db_engine(url, echo=config.echo))
        except DBAPIError as exc:
            file = sqlite_file(url)
            reason = unwritable_reason(exc, file.parent if file is not None else None)
            fallback = read_only_engine(url) if reason is not None else None
            if fallback is None or (config.migrate and not at_head(fallback)):
                raise
        else:
            if config.migrate:  # the migration stamp is there to rewrite
                catalog.recheck_writes(always=True)
            return catalog
        log.error(
            "the catalog at %s cannot be opened for writing (%s): serving it read-only, "
            "degraded, until it can (free space on its volume)",
            file,
            reason,
        )
        return cls(fallback, read_only=f"opened read-only: {reason}", writable_url=url)

    def close(self) -> None:
        self.engine.dispose()

    @property
    def write_error(self) -> str | None:
        """Why the catalog cannot write now (None: its last write worked, as far as it knows)."""
        return self.writes.error

    def recheck_writes(self, always: bool = False) -> bool:
        """While degraded (or `always`), try one small write: True if the catalog writes. A
        read-only fallback is reopened read-write when that works; a failed probe keeps (or
        sets) the error."""
        with self._rechecking:
            if self.writes.error is None and not always:
                return True
            return self._probe()

    def _probe(self) -> bool:
        """The small write, on the read-write database when this is a read-only fallback."""
        url = self._writable_url
        engine = create_db_engine(url) if url is not None else self.engine
        try:
            probe_write(engine)
        except DBAPIError as exc:
            if engine is not self.engine:
                engine.dispose()
            reason = unwritable_reason(exc, self._volume)
            if reason is None:
                raise
            self.writes.failed(self.read_only or reason, counted=False)
            return False
        if engine is not self.engine:  # the read-only fallback gives way
            fallback = self.engine
            self._use(engine)
            self.read_only = self._writable_url = None
            fallback.dispose()
        self.writes.succeeded()
        return True

    @property
    def is_shared(self) -> bool:
        """True for a server database (PostgreSQL) that other replicas may use too; False for
        a SQLite file, which only this machine sees."""
        return self.engine.dialect.name != "sqlite"

    def _reopen_if_due(self) -> None:
        """A read-only fallback: try to reopen read-write if space was freed since the last
        try, or `REOPEN_EVERY_S` passed."""
        now, free = time.monotonic(), free_bytes(self._volume)
        if now - self._reopen_tried < REOPEN_EVERY_S and free <= self._reopen_free:
            return
        self._reopen_tried, self._reopen_free = now, free
        try:
            self.recheck_writes()
        except Exception:  # the transaction asked for goes on, on the read-only fallback
            log.exception("reopening the catalog read-write failed")

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: committed on success, rolled back (and re-raised) on error; a
        write the database refused comes out as `CatalogUnwritable` and degrades the catalog,
        a committed write ends that."""
        if self._writable_url is not None:
            self._reopen_if_due()
        with self._sessions() as session:
            try:
                yield session
                session.commit()
            except IntegrityError as exc:
                session.rollback()
                raise CatalogError(f"catalog integrity error: {exc.orig}") from exc
            except BaseException as exc:
                session.rollback()
                reason = self._refused(exc)
                if reason is not None:
                    raise CatalogUnwritable(reason) from exc
                raise
            if wrote(session):
                self.writes.succeeded()

    def _refused(self, exc: BaseException) -> str | None:
        """Why the database refused a write, if `exc` says so (noted as a failed write)."""
        reason = unwritable_reason(exc, self._volume) if isinstance(exc, DBAPIError) else None
        if reason is None:
            return None
        reason = self.read_only or reason  # a read-only fallback refuses for the reason it is one
        self.writes.failed(reason)
        return reason

    # -- documents -----------------------------------------------------------------------------

    def add_document(
        self, source: str, title: str, content_hash: str, chunks: Sequence[rec.NewChunk]
    ) -> rec.AddedDocument:
        """Store a document and its chunks (ordinals 0..n-1, in the given order) atomically."""
        with self.session() as s:
            document = Document(source=source, title=title, content_hash=content_hash)
            document.chunks = [
                Chunk(
                    ordinal=i,
                    text=c.text,
                    num_tokens=c.num_tokens,
                    token_ids_hash=c.token_ids_hash,
                    embedding_row=c.embedding_row,
                )
                for i, c in enumerate(chunks)
            ]
            s.add(document)
            s.flush()
            return rec.AddedDocument(
                rec.document_record(document, len(chunks)),
                tuple(rec.chunk_record(c) for c in document.chunks),
            )

    def get_document(
        self, document_id: int, state: DocumentState | None = None
    ) -> rec.DocumentRecord | None:
        """The document, or None; `state` as in `list_documents` (a document in another state is
        None)."""
        with self.session() as s:
            query = _in_state(select(Document).where(Document.id == document_id), state)
            rows = self._documents_with_counts(s, query)
            return rows[0] if rows else None

    def list_documents(
        self, offset: int = 0, limit: int = 100, state: DocumentState | None = None
    ) -> list[rec.DocumentRecord]:
        """Documents by id (oldest first). `state`: "ready", only those whose ingest finished
        (retrievable); "ingesting", only those under an ingest row (running, or a crash
        leftover until its lease expires); None, both."""
        with self.session() as s:
            query = (
                _in_state(select(Document), state).order_by(Document.id).offset(offset).limit(limit)
            )
            return self._documents_with_counts(s, query)

    def count_documents(self, state: DocumentState | None = None) -> int:
        """How many documents `list_documents(state=state)` pages through."""
        with self.session() as s:
            return int(s.scalar(_in_state(select(func.count()).select_from(Document), state)) or 0)

    def find_documents_by_hash(
        self, content_hash: str, state: DocumentState | None = None
    ) -> list[rec.DocumentRecord]:
        """Documents with this content, oldest first; `state` as in `list_documents`."""
        with self.session() as s:
            query = _in_state(
                select(Document).where(Document.content_hash == content_hash), state
            ).order_by(Document.id)
            return self._documents_with_counts(s, query)

    def delete_document(self, document_id: int) -> rec.DeletedDocument | None:
        """Delete a document, its chunks and their variants; None if there was no such document.

        The returned store keys are the variants' KV; the caller removes them from the store
        (a crash in between leaves orphan KV, which the orphan sweep removes). The chunks'
        `remove` entries go to the change log in the same transaction, so every replica's
        index drops them.
        """
        with self.session() as s:
            document = s.get(Document, document_id)
            if document is None:
                return None
            chunk_ids = select(Chunk.id).where(Chunk.document_id == document_id)
            keys = s.scalars(select(Variant.store_key).where(Variant.chunk_id.in_(chunk_ids))).all()
            num_chunks = s.scalar(
                select(func.count()).select_from(Chunk).where(Chunk.document_id == document_id)
            )
            append_changes(s, REMOVE, list(s.scalars(chunk_ids.order_by(Chunk.id))))
            # Explicit deletes, so the cascade never depends on the database enforcing it.
            s.execute(delete(Ingest).where(Ingest.document_id == document_id))
            s.execute(delete(Variant).where(Variant.chunk_id.in_(chunk_ids)))
            s.execute(delete(Chunk).where(Chunk.document_id == document_id))
            s.execute(delete(Document).where(Document.id == document_id))
            return rec.DeletedDocument(document_id, int(num_chunks or 0), tuple(keys))

    def _documents_with_counts(
        self, s: Session, query: Select[Document]
    ) -> list[rec.DocumentRecord]:
        documents = s.scalars(query).all()
        if not documents:
            return []
        ids = [d.id for d in documents]
        counts = dict(
            s.execute(
                select(Chunk.document_id, func.count())
                .where(Chunk.document_id.in_(ids))
                .group_by(Chunk.document_id)
            ).all()
        )
        return [rec.document_record(d, int(counts.get(d.id, 0))) for d in documents]

    # -- chunks --------------------------------------------------------------------------------

    def get_chunk(self, chunk_id: int) -> rec.ChunkRecord | None:
        with self.session() as s:
            row = s.get(Chunk, chunk_id)
            return rec.chunk_record(row) if row is not None else None

    def get_chunks(self, chunk_ids: Sequence[int]) -> list[rec.ChunkRecord | None]:
        """Chunks in the order asked; None where an id does not exist."""
        with self.session() as s:
            found = {c.id: c for c in _select_in(s, Chunk, Chunk.id, chunk_ids)}
            return [rec.chunk_record(found[i]) if i in found else None for i in chunk_ids]

    def chunks_of_document(self, document_id: int) -> list[rec.ChunkRecord]:
        with self.session() as s:
            rows = s.scalars(
                select(Chunk).where(Chunk.document_id == document_id).order_by(Chunk.ordinal)
            )
            return [rec.chunk_record(c) for c in rows]

    def chunks_by_embedding_rows(self, rows: Sequence[int]) -> list[rec.ChunkRecord | None]:
        """Map FAISS rows to chunks, in the order asked; None where no chunk has that row."""
        with self.session() as s:
            found = {c.embedding_row: c for c in _select_in(s, Chunk, Chunk.embedding_row, rows)}
            return [rec.chunk_record(found[r]) if r in found else None for r in rows]

    def set_embedding_rows(self, rows_by_chunk: dict[int, int | None]) -> None:
        """Assign FAISS rows to chunks (all or nothing); a row used twice raises CatalogError.

        Logs nothing to the change log, so other replicas do not see it: ingests commit
        through `finish_ingest`, which does."""
        with self.session() as s:
            for chunk_id, row in rows_by_chunk.items():
                s.execute(update(Chunk).where(Chunk.id == chunk_id).values(embedding_row=row))

    def max_embedding_row(self) -> int | None:
        with self.session() as s:
            return s.scalar(select(func.max(Chunk.embedding_row)))

    # -- variants ------------------------------------------------------------------------------

    def put_variant(self, new: rec.NewVariant) -> rec.VariantRecord:
        """Insert the variant, or refresh the row with the same store key (status back to ready).

        Call it only after the KV is in the store. Access counts survive a refresh; the
        statistics are replaced by `new.stats` where given.
        """
        try:
            return self._upsert_variant(new)
        except CatalogError:
            # Two writers inserting the same key race on the unique index: the loser updates.
            return self._upsert_variant(new)

    def _upsert_variant(self, new: rec.NewVariant) -> rec.VariantRecord:
        with self.session() as s:
            row = s.scalar(select(Variant).where(Variant.store_key == new.store_key))
            if row is None:
                row = Variant(store_key=new.store_key, access_count=0)
                s.add(row)
            row.chunk_id, row.context_signature = new.chunk_id, rec.context_signature(new.context)
            row.lead_signature = rec.context_signature(new.lead)
            row.model_fingerprint, row.prefix_digest = new.model_fingerprint, new.prefix_digest
            row.storage_dtype, row.tier, row.status = new.storage_dtype, new.tier, READY
            row.num_bytes, row.num_tokens = new.num_bytes, new.num_tokens
            _apply_stats(row, new.stats)
            s.flush()
            return rec.variant_record(row)

    def get_variant(self, store_key: str) -> rec.VariantRecord | None:
        with self.session() as s:
            row = s.scalar(select(Variant).where(Variant.store_key == store_key))
            return rec.variant_record(row) if row is not None else None

    def variants_of_chunk(
        self, chunk_id: int, model_fingerprint: str | None = None, status: str | None = READY
    ) -> list[rec.VariantRecord]:
        """The chunk's variants (oldest first), optionally of one model and one status."""
        with self.session() as s:
            query = select(Variant).where(Variant.chunk_id == chunk_id).order_by(Variant.id)
            if model_fingerprint is not None:
                query = query.where(Variant.model_fingerprint == model_fingerprint)
            if status is not None:
                query = query.where(Variant.status == status)
            return [rec.variant_record(v) for v in s.scalars(query)]

    def record_access(self, store_keys: Iterable[str], when: datetime | None = None) -> int:
        """Count one use of each variant; returns how many rows were updated."""
        when = when or utcnow()
        with self.session() as s:
            total = 0
            for batch in _batches(list(store_keys)):
                total += rows_changed(
                    s,
                    update(Variant)
                    .where(Variant.store_key.in_(batch))
                    .values(access_count=Variant.access_count + 1, last_access_at=when),
                )
            return total

    def update_variant_stats(self, store_key: str, stats: VariantStats) -> bool:
        """Replace the given (non-None) statistics; False if no such variant."""
        with self.session() as s:
            row = s.scalar(select(Variant).where(Variant.store_key == store_key))
            if row is None:
                return False
            _apply_stats(row, stats)
            return True

    def set_variant_tier(self, store_key: str, tier: str) -> bool:
        with self.session() as s:
            return (
                rows_changed(
                    s, update(Variant).where(Variant.store_key == store_key).values(tier=tier)
                )
                > 0
            )

    def mark_missing(self, store_keys: Iterable[str]) -> int:
        """Mark variants whose KV is gone; returns how many rows changed."""
        return self._set_status(store_keys, MISSING)

    def _set_status(self, store_keys: Iterable[str], status: str) -> int:
        with self.session() as s:
            total = 0
            for batch in _batches(list(store_keys)):
                total += rows_changed(
                    s,
                    update(Variant)
                    .where(Variant.store_key.in_(batch), Variant.status != status)
                    .values(status=status),
                )
            return total

    def delete_variants(self, store_keys: Iterable[str]) -> int:
        with self.session() as s:
            total = 0
            for batch in _batches(list(store_keys)):
                total += rows_changed(s, delete(Variant).where(Variant.store_key.in_(batch)))
            return total

    def mark_ready(self, tiers_by_key: dict[str, str]) -> int:
        """Set status ready and the given tier for each store key; returns rows changed."""
        with self.session() as s:
            total = 0
            for key, tier in tiers_by_key.items():
                total += rows_changed(
                    s,
                    update(Variant).where(Variant.store_key == key).values(status=READY, tier=tier),
                )
            return total

    def variant_locations(self) -> dict[str, rec.VariantLocation]:
        """{store key: status, tier, access count, expected savings} of every variant."""
        with self.session() as s:
            rows = s.execute(
                select(
                    Variant.store_key,
                    Variant.status,
                    Variant.tier,
                    Variant.access_count,
                    Variant.expected_savings,
                )
            )
            return {
                key: rec.VariantLocation(status, tier, count, savings)
                for key, status, tier, count, savings in rows
            }

    def variant_contexts(
        self, model_fingerprint: str, prefix_digest: str
    ) -> list[rec.VariantContext]:
        """Every ready variant of one model and system prefix (neighbour-conditioned bases left
        out: exact in no prompt, no path of the prefix tree): key, chunk, context, codec, tier."""
        with self.session() as s:
            rows = s.execute(
                select(
                    Variant.store_key,
                    Variant.chunk_id,
                    Variant.context_signature,
                    Variant.storage_dtype,
                    Variant.tier,
                ).where(
                    Variant.status == READY,
                    Variant.model_fingerprint == model_fingerprint,
                    Variant.prefix_digest == prefix_digest,
                    Variant.lead_signature == "",
                )
            )
            return [
                rec.VariantContext(
                    key, chunk_id, rec.parse_context_signature(signature), dtype, tier
                )
                for key, chunk_id, signature, dtype, tier in rows
            ]

    def variant_statuses(self) -> dict[str, str]:
        """{store key: status} of every variant (start-up reconciliation reads this)."""
        with self.session() as s:
            return dict(s.execute(select(Variant.store_key, Variant.status)).all())

    # -- stats ---------------------------------------------------------------------------------

    def ready_bytes_by_kind(self) -> dict[str, int]:
        """KV bytes of the ready variants by kind and codec: `base:<codec>` (empty context; a
        base's float copy under a lossy base codec shows as its own codec), `context:<codec>`
        (Cache-Craft's and the harvest's context variants) and `conditioned:<codec>`
        (neighbour-conditioned bases)."""
        kind = case(
            (Variant.lead_signature != "", "conditioned"),
            (Variant.context_signature == "", "base"),
            else_="context",
        ).label("kind")  # grouped by its label: one bound expression
        with self.session() as s:
            rows = s.execute(
                select(kind, Variant.storage_dtype, func.sum(Variant.num_bytes))
                .where(Variant.status == READY)
                .group_by(kind, Variant.storage_dtype)
            ).all()
            return {f"{k}:{codec}": int(total) for k, codec, total in rows}

    def stats(self) -> rec.CatalogStats:
        with self.session() as s:
            by_status = dict(
                s.execute(select(Variant.status, func.count()).group_by(Variant.status)).all()
            )
            by_tier = s.execute(
                select(Variant.tier, func.sum(Variant.num_bytes))
                .where(Variant.status == READY)
                .group_by(Variant.tier)
            ).all()
            accesses = s.scalar(select(func.sum(Variant.access_count))) or 0
            return rec.CatalogStats(
                _count(s, Document),
                _count(s, Chunk),
                int(by_status.get(READY, 0)),
                int(by_status.get(MISSING, 0)),
                {t: int(b) for t, b in by_tier},
                int(accesses),
            )


def _in_state(query: Select[Any], state: DocumentState | None) -> Select[Any]:
    """`query` over documents narrowed to `state` (see `Catalog.list_documents`)."""
    if state is None:
        return query
    ingesting = exists().where(Ingest.document_id == Document.id)
    return query.where(ingesting if state == "ingesting" else ~ingesting)


def _count(s: Session, model: type[Base]) -> int:
    return int(s.scalar(select(func.count()).select_from(model)) or 0)


def _apply_stats(row: Variant, stats: VariantStats) -> None:
    for name in ("a", "b", "cci", "inter_scores", "token_scores", "expected_savings"):
        value = getattr(stats, name)
        if value is not None:
            setattr(row, name, value)


def _batches(items: list[Item], size: int = _IN_BATCH) -> Iterator[list[Item]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _select_in(
    s: Session, model: type[Model], column: InstrumentedAttribute[Key | None], values: Sequence[Key]
) -> list[Model]:
    """Rows of `model` whose `column` is one of `values` (distinct; any order), IN batch by
    batch."""
    out: list[Model] = []
    for batch in _batches(list(dict.fromkeys(values))):
        out.extend(s.scalars(select(model).where(column.in_(batch))))
    return out
