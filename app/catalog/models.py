"""SQLAlchemy 2 models of the catalog: documents, their chunks, and the chunks' KV variants.

A *variant* is one cached KV of one chunk, computed under one context (the ordered ids of
the chunks that preceded it; empty for the base variant, computed alone after the system
prefix) by one model. Its KV bytes live in the tiered store under `store_key`; the row only
says where, how big, how often used, and carries the Cache-Craft statistics of that context.

Scale-out tables (migration `0002`): each chunk carries its embedding (the vector index of
every replica is rebuilt from, and follows, the catalog); `index_changes` is the ordered log
of chunks entering and leaving retrieval that replicas follow; `ingests` holds one row per
document being ingested, with its owner and lease (see engine/README.md, "Write order").

The schema is created by Alembic (`migrations/`), never by `create_all` in the app; the
migrations at head must stay identical to these models (a test compares them).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Variant.status values.
READY = "ready"  # the KV is in some tier of the store
MISSING = "missing"  # the KV was lost (evicted from the last tier, crash, corruption)
VARIANT_STATUSES = (READY, MISSING)

# IndexChange.op values: the chunk became retrievable / stopped being retrievable.
ADD = "add"
REMOVE = "remove"

# Ingest.state values. A row exists only while a document is not yet retrievable.
RUNNING = "running"  # the owner is computing KV; it renews `lease_expires_at`
RECLAIMING = "reclaiming"  # the lease expired; a replica (the new owner) is deleting it
INGEST_STATES = (RUNNING, RECLAIMING)


def utcnow() -> datetime:
    return datetime.now(UTC)


# Deterministic constraint names, so later migrations (SQLite batch mode included) can name
# what they alter.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Document(Base):
    """One ingested document. Deleting it deletes its chunks and their variants."""

    __tablename__ = "documents"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source: Mapped[str] = mapped_column(String(1024))
    # sha256 hex of the document's content, for de-duplication by the ingest service.
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    title: Mapped[str] = mapped_column(String(1024), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    chunks: Mapped[list[Chunk]] = relationship(
        back_populates="document",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="Chunk.ordinal",
    )


class Chunk(Base):
    """One chunk of a document, in document order (`ordinal` 0, 1, ...)."""

    __tablename__ = "chunks"
    __table_args__ = (
        UniqueConstraint("document_id", "ordinal", name="uq_chunks_document_ordinal"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    document_id: Mapped[int] = mapped_column(
        ForeignKey("documents.id", ondelete="CASCADE"), index=True
    )
    ordinal: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    num_tokens: Mapped[int] = mapped_column(Integer)
    # sha256 hex of the chunk's token ids under the tokenizer that ingested it.
    token_ids_hash: Mapped[str] = mapped_column(String(64), index=True)
    # Row of the chunk's embedding in the retriever's FAISS index (None: not indexed yet).
    embedding_row: Mapped[int | None] = mapped_column(BigInteger, unique=True, nullable=True)
    # The embedding of the chunk's "title\ntext" (float32 little-endian, unit length) and the
    # name of the embedder that made it; None for chunks ingested before migration 0002.
    embedding: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    embedder: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    document: Mapped[Document] = relationship(back_populates="chunks")
    variants: Mapped[list[Variant]] = relationship(
        back_populates="chunk",
        cascade="all, delete-orphan",
        passive_deletes=True,
    )


class Variant(Base):
    """One cached KV of a chunk under one context, and its statistics.

    `context_signature` is the comma-joined ordered chunk ids before the chunk ("" = base).
    `lead_signature` those whose openings preceded a neighbour-conditioned base (migration
    `0003`; "" for every other variant: `engine.kv.ChunkKV.lead`).
    `store_key` is the cache key of the KV in the tiered store (unique). `tier` is the
    fastest tier that held the KV when last known; `status` is READY or MISSING.
    Cache-Craft columns (all nullable until measured): `a`, `b`, `cci`, `inter_scores`
    ({prefix chunk id: inter-attention score}), `token_scores` ([per-token inter-attention],
    one float per chunk token) and `expected_savings` (prefill tokens one use saves).
    """

    __tablename__ = "variants"
    __table_args__ = (Index("ix_variants_chunk_fingerprint", "chunk_id", "model_fingerprint"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    chunk_id: Mapped[int] = mapped_column(ForeignKey("chunks.id", ondelete="CASCADE"), index=True)
    context_signature: Mapped[str] = mapped_column(Text, default="")
    lead_signature: Mapped[str] = mapped_column(Text, default="", server_default="")
    model_fingerprint: Mapped[str] = mapped_column(String(64))
    prefix_digest: Mapped[str] = mapped_column(String(64))
    storage_dtype: Mapped[str] = mapped_column(String(16))
    store_key: Mapped[str] = mapped_column(String(64), unique=True)
    tier: Mapped[str] = mapped_column(String(16))
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    num_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=READY, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    access_count: Mapped[int] = mapped_column(Integer, default=0)
    last_access_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    a: Mapped[float | None] = mapped_column(Float, nullable=True)
    b: Mapped[float | None] = mapped_column(Float, nullable=True)
    cci: Mapped[float | None] = mapped_column(Float, nullable=True)
    inter_scores: Mapped[dict[str, float] | None] = mapped_column(JSON, nullable=True)
    token_scores: Mapped[list[float] | None] = mapped_column(JSON, nullable=True)
    expected_savings: Mapped[float | None] = mapped_column(Float, nullable=True)

    chunk: Mapped[Chunk] = relationship(back_populates="variants")


class IndexChange(Base):
    """One entry of the retrieval change log: chunk `chunk_id` was added to or removed from
    retrieval. `seq` grows in commit order (writers serialise on a lock, see
    `app.catalog.changes`), so a replica that applied everything up to `seq` misses nothing
    by reading `seq > cursor`. No foreign key: a removal outlives its chunk."""

    __tablename__ = "index_changes"

    seq: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    chunk_id: Mapped[int] = mapped_column(Integer)
    op: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Ingest(Base):
    """A document being ingested: who owns the work and until when (the lease).

    The owner renews `lease_expires_at` while it computes KV and deletes the row when the
    document becomes retrievable. A row whose lease expired is a crash leftover: any replica
    may claim it (state RECLAIMING, itself as owner) and delete the document.
    """

    __tablename__ = "ingests"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    document_id: Mapped[int] = mapped_column(
        ForeignKey("documents.id", ondelete="CASCADE"), unique=True
    )
    owner: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), default=RUNNING)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    lease_expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
