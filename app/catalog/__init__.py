"""The catalog: documents, chunks and chunk KV variants, in SQLite or PostgreSQL.

Public API (stable; the service and the chunk cache build on it):

- `CatalogConfig(url=None, data_dir=Path("data"), migrate=True, echo=False)`: where the
  database lives; `url` None = SQLite file `<data_dir>/catalog.db` (WAL, foreign keys on).
- `Catalog.open(config)` migrates to head and connects; `Catalog(engine)` wraps a pool.
  Documents: `add_document(source, title, content_hash, [NewChunk])` (atomic) →
  `AddedDocument`, `get_document`, `list_documents`, `find_documents_by_hash`,
  `delete_document` (cascades; returns the store keys to drop).
  Chunks: `get_chunk`, `get_chunks`, `chunks_of_document`, `chunks_by_embedding_rows`
  (FAISS row → chunk), `set_embedding_rows`, `max_embedding_row`.
  Variants: `put_variant(NewVariant)` (insert or refresh by store key), `get_variant`,
  `variants_of_chunk`, `record_access`, `update_variant_stats`, `set_variant_tier`,
  `mark_missing`, `mark_ready`, `delete_variants`, `variant_statuses`,
  `variant_locations`, `variant_contexts` (the prefix tree's rows). Totals: `stats()`.
  Writes the database refuses (no space, a read-only volume) raise `CatalogUnwritable` and
  leave `write_error` set until one works (`recheck_writes` probes); a SQLite catalog on a
  full volume opens read-only (`read_only`).
  Ingest leases: `begin_ingest` (document + chunks with embeddings + a RUNNING row owned
  by a replica), `heartbeat`, `finish_ingest` (the commit point; `LeaseLost` if reclaimed),
  `expired_ingests`, `claim_ingest`, `ingest_of`, `ingests`.
  Change log: `last_change_seq`, `changes_since(cursor)`, `prune_changes`,
  `indexed_chunk_ids`, `indexed_chunks_by_id`, `iter_indexed_chunks` (what every
  replica's vector index is built from and follows).
- `upgrade_to_head(url)` / `downgrade_to_base(url)`: Alembic migrations from code.
- `context_signature(chunk_ids)`: the stored form of a variant's context ("" = base).

The catalog stores no KV bytes; those live in `app.store` under each variant's key.
"""

from app.catalog.db import CatalogConfig, create_db_engine, default_sqlite_url
from app.catalog.faults import CatalogError, CatalogUnwritable, unwritable_reason
from app.catalog.ingests import LeaseLost
from app.catalog.migrate import downgrade_to_base, upgrade_to_head
from app.catalog.models import ADD, MISSING, READY, RECLAIMING, REMOVE, RUNNING
from app.catalog.records import (
    AddedDocument,
    CatalogStats,
    ChunkRecord,
    DeletedDocument,
    DocumentRecord,
    IndexChangeRecord,
    IndexedChunk,
    IngestRecord,
    NewChunk,
    NewVariant,
    VariantContext,
    VariantLocation,
    VariantRecord,
    context_signature,
    parse_context_signature,
)
from app.catalog.repository import Catalog, DocumentState
from engine.variant_stats import VariantStats

__all__ = [
    "ADD",
    "MISSING",
    "READY",
    "RECLAIMING",
    "REMOVE",
    "RUNNING",
    "IndexChangeRecord",
    "IndexedChunk",
    "IngestRecord",
    "LeaseLost",
    "AddedDocument",
    "Catalog",
    "CatalogConfig",
    "CatalogError",
    "CatalogUnwritable",
    "CatalogStats",
    "ChunkRecord",
    "DeletedDocument",
    "DocumentRecord",
    "DocumentState",
    "NewChunk",
    "NewVariant",
    "VariantContext",
    "VariantLocation",
    "VariantRecord",
    "VariantStats",
    "context_signature",
    "create_db_engine",
    "default_sqlite_url",
    "downgrade_to_base",
    "parse_context_signature",
    "unwritable_reason",
    "upgrade_to_head",
]
