"""Plain, immutable records the catalog API takes and returns (never live ORM objects).

Returning frozen dataclasses keeps callers (the service, the chunk cache) free of sessions,
lazy loading and detached-instance errors; the ORM models stay inside the repository.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import overload

from app.catalog.models import READY, Chunk, Document, Variant
from engine.kv import ChunkId
from engine.variant_stats import VariantStats


def context_signature(chunk_ids: Sequence[ChunkId]) -> str:
    """The ordered ids of the chunks before a chunk, as stored: "12,7,3" ("" = base variant)."""
    return ",".join(str(int(i)) for i in chunk_ids)


def parse_context_signature(signature: str) -> tuple[ChunkId, ...]:
    return tuple(int(part) for part in signature.split(",")) if signature else ()


@dataclass(frozen=True)
class NewChunk:
    """A chunk to add with its document. `embedding_row`: its FAISS row, if already known;
    `embedding`: its vector as float32 little-endian bytes (see `Catalog.begin_ingest`)."""

    text: str
    num_tokens: int
    token_ids_hash: str
    embedding_row: int | None = None
    embedding: bytes | None = None


@dataclass(frozen=True)
class NewVariant:
    """A variant whose KV was just written to the store under `store_key`."""

    chunk_id: int
    context: tuple[ChunkId, ...]
    model_fingerprint: str
    prefix_digest: str
    storage_dtype: str
    store_key: str
    tier: str
    num_bytes: int
    num_tokens: int
    stats: VariantStats = field(default_factory=VariantStats)
    lead: tuple[ChunkId, ...] = ()  # a neighbour-conditioned base's lead (`ChunkKV.lead`)


@dataclass(frozen=True)
class DocumentRecord:
    id: int
    source: str
    content_hash: str
    title: str
    created_at: datetime
    num_chunks: int


@dataclass(frozen=True)
class ChunkRecord:
    id: int
    document_id: int
    ordinal: int
    text: str
    num_tokens: int
    token_ids_hash: str
    embedding_row: int | None


@dataclass(frozen=True)
class VariantRecord:
    id: int
    chunk_id: int
    context: tuple[ChunkId, ...]
    model_fingerprint: str
    prefix_digest: str
    storage_dtype: str
    store_key: str
    tier: str
    num_bytes: int
    num_tokens: int
    status: str
    created_at: datetime
    access_count: int
    last_access_at: datetime | None
    stats: VariantStats
    lead: tuple[ChunkId, ...] = ()  # a neighbour-conditioned base's lead (`ChunkKV.lead`)

    @property
    def is_ready(self) -> bool:
        return self.status == READY

    @property
    def is_conditioned(self) -> bool:
        """A neighbour-conditioned base: exact in no prompt, read only when a request asks."""
        return bool(self.lead)


@dataclass(frozen=True)
class VariantContext:
    """A ready variant as the prefix tree of chunk sequences needs it (app/kvcache/chunk_tree.py):
    its store key, its chunk, the ordered chunk ids it was computed after, its codec, and the
    fastest tier that held it when last known."""

    store_key: str
    chunk_id: int
    context: tuple[ChunkId, ...]
    storage_dtype: str
    tier: str = ""


@dataclass(frozen=True)
class VariantLocation:
    """Where the catalog believes a variant's KV is, and what eviction needs of it."""

    status: str
    tier: str
    access_count: int
    expected_savings: float | None


@dataclass(frozen=True)
class AddedDocument:
    document: DocumentRecord
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True)
class DeletedDocument:
    """What a delete removed; `store_keys` are the variants' KV keys to drop from the store."""

    document_id: int
    num_chunks: int
    store_keys: tuple[str, ...]


@dataclass(frozen=True)
class CatalogStats:
    num_documents: int
    num_chunks: int
    num_variants_ready: int
    num_variants_missing: int
    ready_bytes_by_tier: dict[str, int]
    total_accesses: int


@dataclass(frozen=True)
class IndexedChunk:
    """A retrievable chunk as the vector index needs it: the text it embeds ("title\ntext")
    and the stored embedding, if any (None: ingested before migration 0002, embed the text)."""

    chunk_id: int
    title: str
    text: str
    embedder: str | None
    embedding: bytes | None

    @property
    def embedding_text(self) -> str:
        return f"{self.title}\n{self.text}"


@dataclass(frozen=True)
class IndexChangeRecord:
    """One entry of the retrieval change log. `chunk` is set for an `add` whose chunk still
    exists (None: removed since; a later `remove` entry follows)."""

    seq: int
    chunk_id: int
    op: str
    chunk: IndexedChunk | None


@dataclass(frozen=True)
class IngestRecord:
    """A document not yet retrievable: who ingests it, in which state, until when."""

    document_id: int
    owner: str
    state: str
    started_at: datetime
    lease_expires_at: datetime


@overload
def aware(moment: datetime) -> datetime: ...


@overload
def aware(moment: None) -> None: ...


def aware(moment: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC, so say so."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def document_record(row: Document, num_chunks: int) -> DocumentRecord:
    return DocumentRecord(
        row.id, row.source, row.content_hash, row.title, aware(row.created_at), num_chunks
    )


def chunk_record(row: Chunk) -> ChunkRecord:
    return ChunkRecord(
        row.id,
        row.document_id,
        row.ordinal,
        row.text,
        row.num_tokens,
        row.token_ids_hash,
        row.embedding_row,
    )


def variant_record(row: Variant) -> VariantRecord:
    # JSON object keys are text: the chunk ids of `inter_scores` come back as ints here
    inter = None if row.inter_scores is None else {int(k): v for k, v in row.inter_scores.items()}
    stats = VariantStats(row.a, row.b, row.cci, inter, row.token_scores, row.expected_savings)
    return VariantRecord(
        row.id,
        row.chunk_id,
        parse_context_signature(row.context_signature),
        row.model_fingerprint,
        row.prefix_digest,
        row.storage_dtype,
        row.store_key,
        row.tier,
        row.num_bytes,
        row.num_tokens,
        row.status,
        aware(row.created_at),
        row.access_count,
        aware(row.last_access_at),
        stats,
        parse_context_signature(row.lead_signature or ""),
    )
