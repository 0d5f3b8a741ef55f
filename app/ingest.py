"""Ingest documents: chunk → embed → catalog rows → base KV into the store → index rows.

All or nothing per document: the document is visible to retrieval only once its chunks have
index rows, which is the last step; a failure before that deletes what was written (catalog
rows, KV, index rows). A crash in between leaves chunks without embedding rows, which
`remove_incomplete` deletes at the next start. Idempotent: content already ingested (same
sha256 of the text) is reported, not added again. Ingests run one at a time.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.retrieve import chunk_token_ids
from engine.catalog import DocumentRecord, NewChunk
from engine.errors import InvalidRequest
from engine.store.entry import token_ids_hash
from retrieval import Chunker, SourceDocument

log = logging.getLogger(__name__)

OnChunk = Callable[[int], None]


@dataclass(frozen=True)
class IngestResult:
    document: DocumentRecord
    created: bool
    num_tokens: int
    seconds: float


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Ingestor:
    def __init__(self, engine, chunker: Chunker, retriever, catalog, chunk_cache):
        self.engine = engine
        self.chunker = chunker
        self.retriever = retriever
        self.catalog = catalog
        self.chunk_cache = chunk_cache
        self._lock = threading.Lock()

    def ingest(self, doc: SourceDocument, on_chunk: OnChunk | None = None) -> IngestResult:
        """Add one document (or find it already there); `on_chunk(n)` reports KV progress."""
        started = time.perf_counter()
        digest = content_hash(doc.text)
        with self._lock:
            existing = self.catalog.find_documents_by_hash(digest)
            if existing:
                return IngestResult(existing[0], False, 0, time.perf_counter() - started)
            pieces = self.chunker.split(doc.text)
            if not pieces:
                raise InvalidRequest(f"{doc.source}: the document has no text")
            ids = [chunk_token_ids(self.engine, p.text, doc.title) for p in pieces]
            vectors = self.retriever.embed([f"{doc.title}\n{p.text}" for p in pieces])
            added = self.catalog.add_document(doc.source, doc.title, digest,
                                              [NewChunk(p.text, len(t), token_ids_hash(t)) for p, t in zip(pieces, ids)])
            try:
                self._compute_kv(added.chunks, ids, on_chunk)
                chunk_ids = [c.id for c in added.chunks]
                self.catalog.set_embedding_rows({i: i for i in chunk_ids})  # the commit point
                self.retriever.add(chunk_ids, vectors)
                self.retriever.save()
            except BaseException:
                self._undo(added.document.id, [c.id for c in added.chunks])
                raise
        return IngestResult(added.document, True, sum(len(t) for t in ids), time.perf_counter() - started)

    def delete(self, document_id: int) -> bool:
        """Remove a document's index rows, catalog rows and KV; False if there is no such document."""
        with self._lock:
            chunks = self.catalog.chunks_of_document(document_id)
            self.retriever.remove([c.id for c in chunks])  # first: stop retrieving it
            deleted = self.chunk_cache.forget_document(document_id)  # catalog rows, then KV
            if chunks:
                self.retriever.save()
            return deleted is not None

    def remove_incomplete(self) -> int:
        """Delete documents left half-ingested by a crash (chunks without index rows)."""
        removed = 0
        for document in list(iter_documents(self.catalog)):  # deleting shifts the pages
            chunks = self.catalog.chunks_of_document(document.id)
            if not chunks or any(c.embedding_row is None for c in chunks):
                log.warning("removing half-ingested document %d (%s)", document.id, document.source)
                removed += int(self.delete(document.id))
        return removed

    def _compute_kv(self, chunks, ids, on_chunk: OnChunk | None) -> None:
        for chunk, token_ids in zip(chunks, ids):
            self.chunk_cache.put_base(chunk.id, token_ids)
            if on_chunk is not None:
                on_chunk(1)

    def _undo(self, document_id: int, chunk_ids: list[int]) -> None:
        try:
            self.retriever.remove(chunk_ids)
            self.chunk_cache.forget_document(document_id)
        except Exception:  # the original error matters more; start-up repairs the rest
            log.exception("could not undo the failed ingest of document %d", document_id)


def iter_documents(catalog, page: int = 500):
    """Every document, oldest first, read page by page."""
    offset = 0
    while True:
        batch = catalog.list_documents(offset=offset, limit=page)
        yield from batch
        if len(batch) < page:
            return
        offset += page


def iter_chunk_texts(catalog):
    """(chunk id, embedding text) of every indexed chunk: what the vector index is rebuilt from."""
    for document in iter_documents(catalog):
        for chunk in catalog.chunks_of_document(document.id):
            if chunk.embedding_row is not None:
                yield chunk.id, f"{document.title}\n{chunk.text}"
