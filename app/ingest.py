"""Ingest documents: chunk → embed → catalog rows + lease → base KV into the store → commit.

All or nothing per document: the document, its chunks and their embeddings are written with
an ingest row that this replica owns and renews (`app.replica.LeaseKeeper`); the document
becomes retrievable only at `Catalog.finish_ingest`, the commit point, which also logs its
chunks for every replica's index. A failure before it deletes what was written (catalog rows,
KV); if even that fails (a full catalog), the rows stay under their ingest row, never listed
as ready, until the next ingest of the same content or the lease's expiry removes them. After
the commit point nothing is undone: the local index is updated and saved, and a save that
fails leaves the index degraded (`VectorIndex.write_error`), not the ingest. A commit that
raised is checked in the catalog before it is reported failed. A crash leaves an ingest row
whose lease stops being renewed; once it expires, any replica deletes it (`reclaim_expired`);
a peer's live ingest is never touched (the same content sent meanwhile is refused with
`IngestInProgress`). Idempotent: content already ingested (same sha256 of the text) is
reported, not added again. Ingests of one process run one at a time.

KV: `eager` (default) computes every chunk's base variant now, in packed batches
(`Engine.encode_chunks`), so the first question over the document reuses it. `lazy` skips
that: the document is searchable as soon as it is committed, ingest costs only chunking and
embedding, and the first request that retrieves a chunk computes its base variant (a
prefill of that chunk, in that request's TTFT) and stores it for the next one. Lazy suits
large corpora of which little is ever asked; eager suits documents that will be asked about.
With `KVMOSAIC_CONDITIONED_NEIGHBOURS` set, an eager ingest also computes each chunk's
neighbour-conditioned base (`app.kvcache.conditioned`) before the commit; a lazy one leaves
them to `kvmosaic condition`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from app.catalog import (
    AddedDocument,
    Catalog,
    CatalogUnwritable,
    ChunkRecord,
    DocumentRecord,
    LeaseLost,
    NewChunk,
)
from app.catalog.models import utcnow
from app.replica import LeaseKeeper, reclaim_expired
from app.retrieve import chunk_token_ids
from app.store.entry import token_ids_hash
from engine.errors import InvalidRequest, KvMosaicError
from retrieval import Chunker, Retriever, SourceDocument, TextChunk

if TYPE_CHECKING:
    from app.kvcache.chunk_cache import ServiceChunkCache
    from app.kvcache.conditioned import BaseConditioner
    from engine.engine import Engine

log = logging.getLogger(__name__)

OnProgress = Callable[[int, int], None]  # (chunks, tokens) whose base KV was just stored
# What an ingest does with base KV: compute it now, or on the chunk's first retrieval.
KvMode = Literal["eager", "lazy"]
KV_MODES: tuple[KvMode, ...] = ("eager", "lazy")


@dataclass(frozen=True)
class IngestResult:
    """`kv_tiers`: how many chunks' base KV each tier took ("none": no tier could; computed
    on first use). A memory tier here means the persistent tiers were down or could not
    write: `kv_memory_only` counts those chunks (copied to the persistent tier once it can
    write, `app.kvcache.persist`)."""

    document: DocumentRecord
    created: bool
    num_tokens: int
    seconds: float
    kv_tiers: dict[str, int] = field(default_factory=dict)
    kv: KvMode = "eager"  # lazy: no base KV yet (kv_tiers empty); computed on first retrieval
    kv_memory_only: int = 0
    kv_conditioned: int = 0  # chunks whose neighbour-conditioned base was stored


class IngestInProgress(KvMosaicError):
    """The same content is being ingested by another process (or was, by one that crashed,
    until its lease expires): send it again in `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Ingestor:
    def __init__(
        self,
        engine: Engine,
        chunker: Chunker,
        retriever: Retriever,
        catalog: Catalog,
        chunk_cache: ServiceChunkCache,
        leases: LeaseKeeper,
        kv: str = "eager",
        conditioner: BaseConditioner | None = None,
    ):
        """`kv`: what `ingest` does with base KV when the caller names nothing (`KV_MODES`);
        `conditioner`: computes neighbour-conditioned bases at an eager ingest (None: none)."""
        self.kv = _check_kv(kv)
        self.conditioner = conditioner
        self.engine = engine
        self.chunker = chunker
        self.retriever = retriever
        self.catalog = catalog
        self.chunk_cache = chunk_cache
        self.leases = leases
        self._lock = threading.Lock()

    def ingest(
        self, doc: SourceDocument, on_progress: OnProgress | None = None, kv: str | None = None
    ) -> IngestResult:
        """Add one document (or find it already there); `kv` "eager" or "lazy" (None: the
        ingestor's default); `on_progress(chunks, tokens)` reports stored base KV.
        `CatalogUnwritable` if the catalog refused a write before the commit point (nothing
        added); `IngestInProgress` if another process is ingesting the same text."""
        kv = _check_kv(kv or self.kv)
        started = time.perf_counter()
        digest = content_hash(doc.text)
        with self._lock:
            try:
                existing = self._existing(digest)
                if existing is not None:
                    return IngestResult(existing, False, 0, time.perf_counter() - started, kv=kv)
                return self._add(doc, digest, kv, on_progress, started)
            except CatalogUnwritable as exc:
                raise CatalogUnwritable(exc.reason, "the document was not added") from exc

    def _add(
        self,
        doc: SourceDocument,
        digest: str,
        kv: KvMode,
        on_progress: OnProgress | None,
        started: float,
    ) -> IngestResult:
        """chunk → embed → catalog rows under a lease → base KV → commit → local index."""
        pieces = self.chunker.split(doc.text)
        if not pieces:
            raise InvalidRequest(f"{doc.source}: the document has no text")
        ids = [chunk_token_ids(self.engine, p.text, doc.title) for p in pieces]
        vectors = self.retriever.embed([f"{doc.title}\n{p.text}" for p in pieces])
        added = self._begin(doc, digest, pieces, ids, vectors)
        try:
            kv_tiers, conditioned = Counter[str](), 0
            if kv == "eager":
                kv_tiers = self._compute_kv(added.chunks, ids, on_progress)
                conditioned = self._condition(added.chunks, ids, vectors)
            self._commit(added.document.id)
        except BaseException:
            self._undo(added.document.id)
            raise
        finally:
            self.leases.release(added.document.id)
        self._index([c.id for c in added.chunks], vectors)
        memory_only = sum(
            n
            for tier, n in kv_tiers.items()
            if tier != "none" and self.chunk_cache.is_memory_only(tier)
        )
        return IngestResult(
            added.document,
            True,
            sum(len(t) for t in ids),
            time.perf_counter() - started,
            dict(kv_tiers),
            kv,
            memory_only,
            conditioned,
        )

    def delete(self, document_id: int) -> bool:
        """Remove a document's catalog rows, KV and index rows; False if there is no such
        document. The catalog goes first: if it refuses (`CatalogUnwritable`), nothing changed
        (a search meanwhile drops hits whose chunk is gone, `app.retrieve`)."""
        with self._lock:
            chunks = self.catalog.chunks_of_document(document_id)
            with self.retriever.updating():  # no follower re-adds a chunk between the two steps
                try:
                    deleted = self.chunk_cache.forget_document(document_id)  # catalog, then KV
                except CatalogUnwritable as exc:
                    raise CatalogUnwritable(exc.reason, "the document was not deleted") from exc
                self.retriever.remove([c.id for c in chunks])
            if chunks:
                self.retriever.save()  # a failed save degrades the index, not the delete
            return deleted is not None

    def reclaim_expired(self) -> int:
        """Delete documents whose ingest lease expired (a crashed owner, here or on a peer)."""
        return reclaim_expired(
            self.catalog, self.chunk_cache.forget_document, self.leases.owner, self.leases.lease_s
        )

    def _begin(
        self,
        doc: SourceDocument,
        digest: str,
        pieces: Sequence[TextChunk],
        ids: Sequence[Sequence[int]],
        vectors: npt.NDArray[np.float32],
    ) -> AddedDocument:
        """Catalog rows of the document (not retrievable yet) under a lease this replica holds."""
        chunks = [
            NewChunk(p.text, len(t), token_ids_hash(t), embedding=v.astype("<f4").tobytes())
            for p, t, v in zip(pieces, ids, vectors)
        ]
        added = self.catalog.begin_ingest(
            doc.source,
            doc.title,
            digest,
            chunks,
            self.leases.owner,
            self.leases.lease_s,
            embedder=self.retriever.embedder.name,
        )
        self.leases.hold(added.document.id)
        return added

    def _existing(self, digest: str) -> DocumentRecord | None:
        """The finished document with this content, if any. This process's own failed ingest
        of it (rows its undo could not delete) is deleted first; another's refuses the ingest
        (`IngestInProgress`): it may yet finish, and a document reported as there must be."""
        ready = self.catalog.find_documents_by_hash(digest, state="ready")
        if ready:
            return ready[0]
        for document in self.catalog.find_documents_by_hash(digest, state="ingesting"):
            ingest = self.catalog.ingest_of(document.id)
            if ingest is None:  # it finished meanwhile
                return self.catalog.get_document(document.id)
            if ingest.owner == self.leases.owner:  # ours, and none of ours runs: a leftover
                log.warning("removing document %d, a failed ingest of the same text", document.id)
                self.chunk_cache.forget_document(document.id)
                continue
            wait = (ingest.lease_expires_at - utcnow()).total_seconds()
            raise IngestInProgress(
                f"the same text is being ingested as document {document.id} by {ingest.owner}; "
                "send it again once that ingest has finished (or its lease has expired)",
                max(1, min(int(wait) + 1, int(self.leases.lease_s) + 1)),
            )
        return None

    def _commit(self, document_id: int) -> None:
        """The commit point (`Catalog.finish_ingest`). If it raises, the catalog is asked
        whether the commit happened all the same (a connection lost at COMMIT); if so, the
        ingest goes on as committed, since that is what readers see."""
        try:
            with self.leases.committing(document_id):
                self.catalog.finish_ingest(document_id, self.leases.owner)
        except LeaseLost:
            raise
        except Exception:
            if not self._committed(document_id):
                raise
            log.warning(
                "the commit of document %d raised, but the catalog shows it committed",
                document_id,
                exc_info=True,
            )

    def _committed(self, document_id: int) -> bool:
        try:
            return (
                self.catalog.ingest_of(document_id) is None
                and self.catalog.get_document(document_id) is not None
            )
        except Exception:  # the catalog cannot say: the commit's own error stands
            return False

    def _index(self, chunk_ids: list[int], vectors: npt.NDArray[np.float32]) -> None:
        """After the commit point: the local index takes the chunks and is saved. Neither
        undoes the commit; the change log has the chunks, so the index follower adds any this
        step missed, and a failed save is the index's degraded state (`write_error`)."""
        try:
            self.retriever.add(chunk_ids, vectors)
        except Exception:
            log.exception(
                "the local index could not take chunks %s; the follower adds them", chunk_ids
            )
            return
        self.retriever.save()

    def _compute_kv(
        self,
        chunks: Sequence[ChunkRecord],
        ids: Sequence[Sequence[int]],
        on_progress: OnProgress | None,
    ) -> Counter[str]:
        """Base KV of every chunk into the store, packed; how many chunks each tier took. With
        learned packets, each chunk's base between them too (what a request asking for packets
        reads, `app.rag.with_packets`; not counted in the tiers, reported in the progress)."""
        stored = self.chunk_cache.put_bases(
            [(chunk.id, token_ids) for chunk, token_ids in zip(chunks, ids)], on_progress
        )
        if self.engine.packets is not None:
            self.chunk_cache.put_bases(
                [(c.id, self.engine.packeted(t)) for c, t in zip(chunks, ids)], on_progress
            )
        return Counter(tier or "none" for tier in stored)

    def _condition(
        self,
        chunks: Sequence[ChunkRecord],
        ids: Sequence[Sequence[int]],
        vectors: npt.NDArray[np.float32],
    ) -> int:
        """Neighbour-conditioned bases of the new chunks, if this ingestor computes them; how
        many were stored. They are an optimisation of `fast` reuse: a failure is logged, and
        the document goes in with its plain bases (requests fall back to them)."""
        if self.conditioner is None:
            return 0
        try:
            return self.conditioner.for_ingest(chunks, ids, vectors)
        except (LeaseLost, CatalogUnwritable):
            raise
        except Exception:
            log.exception("conditioned bases of %d chunks not computed", len(chunks))
            return 0

    def _undo(self, document_id: int) -> None:
        """Delete an ingest that did not commit (its rows and KV); nothing was indexed yet."""
        try:
            self.chunk_cache.forget_document(document_id)
        except Exception as exc:  # the original error matters more
            log.warning(
                "could not undo the failed ingest of document %d (%s): it stays unlisted under "
                "its ingest row until the same text is sent again or its lease expires",
                document_id,
                exc,
            )


def _check_kv(kv: str) -> KvMode:
    for mode in KV_MODES:
        if kv == mode:
            return mode
    raise InvalidRequest(f"kv must be one of {', '.join(KV_MODES)}, got {kv!r}")


def iter_documents(catalog: Catalog, page: int = 500) -> Iterator[DocumentRecord]:
    """Every document, oldest first, read page by page."""
    offset = 0
    while True:
        batch = catalog.list_documents(offset=offset, limit=page)
        yield from batch
        if len(batch) < page:
            return
        offset += page


def iter_chunk_texts(catalog: Catalog) -> Iterator[tuple[int, str]]:
    """(chunk id, embedding text) of every indexed chunk."""
    for chunk in catalog.iter_indexed_chunks():
        yield chunk.chunk_id, chunk.embedding_text
