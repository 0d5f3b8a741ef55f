"""`BaseConditioner`: computes and stores chunks' neighbour-conditioned bases (the rules:
`app/variants/conditioned.py`).

At ingest (`for_ingest`), each new chunk's neighbours are drawn from the retriever's index as
it stands and from the document's own other chunks (not indexed until the commit); for a corpus
ingested before conditioning was on, `backfill` (`kvmosaic condition`) computes the bases that
are missing, each chunk's neighbours drawn from the whole index (`--all`: every chunk's again,
so that chunks ingested early get the neighbours that came after them). A base is stored like an
ingested base (first in a persistent tier) under its own key; a chunk without one is served its
plain base, so a failure here costs answers' quality, never an answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from app.catalog import Catalog, ChunkRecord, DocumentRecord
from app.retrieve import chunk_token_ids, documents_of
from app.variants.conditioned import Candidate, Conditioning, lead_of, nearest
from engine.engine import Engine
from engine.kv import ChunkId
from retrieval import Retriever

if TYPE_CHECKING:
    from app.kvcache.chunk_cache import ServiceChunkCache

log = logging.getLogger(__name__)

OnChunk = Callable[[int], None]  # tokens computed for one chunk's conditioned base (lead + chunk)
Scored = list[tuple[float, Candidate]]
SEARCH_MARGIN = 4  # extra index hits, for the chunk itself and copies of its text
GROUP_CHUNKS = 16  # chunks whose bases are packed into passes together (progress between groups)


class BaseConditioner:
    """Thread-safe as its parts are; one per service."""

    def __init__(
        self,
        engine: Engine,
        retriever: Retriever,
        catalog: Catalog,
        chunk_cache: ServiceChunkCache,
        conditioning: Conditioning,
    ):
        self.engine, self.retriever, self.catalog = engine, retriever, catalog
        self.chunk_cache, self.conditioning = chunk_cache, conditioning

    def for_ingest(
        self,
        chunks: Sequence[ChunkRecord],
        token_ids: Sequence[Sequence[int]],
        vectors: npt.NDArray[np.float32],
        on_chunk: OnChunk | None = None,
    ) -> int:
        """Conditioned bases of a document's new chunks (their ids, prompt token ids and
        embeddings, in order); returns how many were stored."""
        own = [Candidate(c.id, c.text, tuple(t)) for c, t in zip(chunks, token_ids)]

        def work() -> Iterator[tuple[Candidate, Scored]]:
            for i, candidate in enumerate(own):
                scored: Scored = [(float(vectors[j] @ vectors[i]), c) for j, c in enumerate(own)]
                yield candidate, scored + self._indexed(vectors[i])

        return self._store_all(work(), on_chunk)

    def backfill(
        self,
        on_chunk: OnChunk | None = None,
        on_present: Callable[[], None] | None = None,
        again: bool = False,
    ) -> tuple[int, int]:
        """Conditioned bases of every indexed chunk that has none of this kind (`again`: of
        every indexed chunk, replacing what is stored); returns (stored, already there).
        Neighbours from the index as it stands. `on_chunk(tokens)` after each one computed,
        `on_present()` for each one skipped."""
        present = 0

        def work() -> Iterator[tuple[Candidate, Scored]]:
            nonlocal present
            for candidate, vector in self._indexed_chunks():
                if not again and self.has(candidate):
                    present += 1
                    if on_present is not None:
                        on_present()
                    continue
                yield candidate, self._indexed(vector)

        stored = self._store_all(work(), on_chunk)
        return stored, present

    def has(self, candidate: Candidate) -> bool:
        """Whether a conditioned base of this kind is stored for the chunk and listed ready."""
        key = self.chunk_cache.conditioned_key(candidate.token_ids, self.conditioning)
        record = self.catalog.get_variant(key)
        return record is not None and record.is_ready and self.chunk_cache.store.contains(key)

    def _store_all(self, work: Iterable[tuple[Candidate, Scored]], on_chunk: OnChunk | None) -> int:
        """Compute and store the conditioned base of each (chunk, scored candidates), packed
        `GROUP_CHUNKS` at a time (`Engine.encode_many_after`); how many were stored. A chunk
        with no neighbour (the only one there is) or whose lead would not fit the model's
        context keeps its plain base only (`on_chunk(0)`)."""
        stored = 0
        for group in _groups(work, GROUP_CHUNKS):
            leads = [self._lead(candidate, scored) for candidate, scored in group]
            ready = [(c, lead) for (c, _), lead in zip(group, leads) if lead is not None]
            if on_chunk is not None:
                for _ in range(len(group) - len(ready)):
                    on_chunk(0)
            kvs = self.engine.encode_many_after(
                [(c.token_ids, ids, lead) for c, (ids, lead) in ready],
                self.chunk_cache.batch_tokens,
            )
            for (candidate, (lead_ids, _)), kv in zip(ready, kvs):
                tier = self.chunk_cache.store_base(candidate.chunk_id, kv, self.conditioning)
                stored += tier is not None
                if on_chunk is not None:
                    on_chunk(len(lead_ids) + len(candidate.token_ids))
        return stored

    def _lead(
        self, candidate: Candidate, scored: Scored
    ) -> tuple[tuple[int, ...], tuple[ChunkId, ...]] | None:
        """The lead ids and lead of `candidate`'s conditioned base; None if it gets none."""
        near = nearest(candidate, scored, self.conditioning.neighbours)
        if not near:
            return None
        lead_ids, lead = lead_of(near, self.conditioning.lead_tokens)
        if not self.engine.fits_after(len(candidate.token_ids), len(lead_ids)):
            log.warning(
                "chunk %d: no conditioned base (it and its lead do not fit the model's context)",
                candidate.chunk_id,
            )
            return None
        return lead_ids, lead

    def _indexed(self, vector: npt.NDArray[np.float32]) -> Scored:
        """The index's nearest chunks to `vector`, scored, with their prompt token ids."""
        hits = self.retriever.search_vector(vector, self.conditioning.neighbours + SEARCH_MARGIN)
        rows = self.catalog.get_chunks([h.chunk_id for h in hits])
        documents = documents_of(self.catalog, [r.document_id for r in rows if r is not None])
        return [
            (hit.score, Candidate(row.id, row.text, _ids(self.engine, row, documents)))
            for hit, row in zip(hits, rows)
            if row is not None and row.document_id in documents
        ]

    def _indexed_chunks(self) -> Iterator[tuple[Candidate, npt.NDArray[np.float32]]]:
        """Every retrievable chunk with its prompt token ids and its embedding (embedded now
        where the catalog has none: a chunk ingested before migration 0002)."""
        for chunk in self.catalog.iter_indexed_chunks():
            if chunk.embedding is not None and chunk.embedder == self.retriever.embedder.name:
                vector = np.frombuffer(chunk.embedding, dtype="<f4").astype(np.float32)
            else:
                vector = self.retriever.embed([chunk.embedding_text])[0]
            token_ids = chunk_token_ids(self.engine, chunk.text, chunk.title)
            yield Candidate(chunk.chunk_id, chunk.text, token_ids), vector


def _groups(
    items: Iterable[tuple[Candidate, Scored]], size: int
) -> Iterator[list[tuple[Candidate, Scored]]]:
    group: list[tuple[Candidate, Scored]] = []
    for item in items:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _ids(engine: Engine, row: ChunkRecord, documents: dict[int, DocumentRecord]) -> tuple[int, ...]:
    return chunk_token_ids(engine, row.text, documents[row.document_id].title)
