"""The retriever: embed a question, search the index; keep the index in step with the chunks.

The chunks' source of truth is the caller's (the catalog): `open` loads the persisted index
when it holds exactly the caller's chunk ids under this embedder, and otherwise rebuilds it
from (id, text) pairs the caller supplies. Knows nothing about documents or the catalog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from retrieval.embedder import Embedder
from retrieval.index import Hit, VectorIndex

log = logging.getLogger(__name__)

# (chunk id, chunk text) pairs, produced lazily: only read when a rebuild is needed.
ChunkTexts = Callable[[], Iterable[tuple[int, str]]]


class Retriever:
    """Thread-safe. Changes are persisted by `save` (the ingest step calls it per document)."""

    def __init__(self, embedder: Embedder, index: VectorIndex, directory: Path | None = None):
        self.embedder = embedder
        self.index = index
        self.directory = directory
        self._save_lock = threading.Lock()

    @classmethod
    def open(cls, embedder: Embedder, directory: Path, chunk_ids: Iterable[int], chunk_texts: ChunkTexts,
             batch_size: int = 256) -> "Retriever":
        """Load the saved index if it is fresh for `chunk_ids`; else rebuild and save it."""
        ids = list(chunk_ids)
        index = VectorIndex.load(directory, embedder.dim, embedder.name, ids)
        retriever = cls(embedder, index or VectorIndex(embedder.dim, embedder.name), directory)
        if index is None:
            retriever.rebuild(chunk_texts(), batch_size)
        return retriever

    def rebuild(self, pairs: Iterable[tuple[int, str]], batch_size: int = 256) -> int:
        """Replace the whole index with embeddings of `pairs`; returns the number of rows."""
        started = time.perf_counter()
        fresh = VectorIndex(self.embedder.dim, self.embedder.name)
        batch: list[tuple[int, str]] = []
        for pair in pairs:
            batch.append(pair)
            if len(batch) == batch_size:
                fresh.add([i for i, _ in batch], self.embedder.encode([t for _, t in batch]))
                batch.clear()
        if batch:
            fresh.add([i for i, _ in batch], self.embedder.encode([t for _, t in batch]))
        self.index = fresh
        self.save()
        log.info("rebuilt the vector index: %d chunks in %.1f s", len(fresh), time.perf_counter() - started)
        return len(fresh)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embedder.encode(texts)

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        self.index.add(ids, vectors)

    def remove(self, ids: Sequence[int]) -> int:
        return self.index.remove(ids)

    def search(self, question: str, k: int) -> list[Hit]:
        """The k chunks closest to the question, best first."""
        return self.index.search(self.embedder.encode([question])[0], k)

    def save(self) -> None:
        if self.directory is not None:
            with self._save_lock:
                self.index.save(self.directory)

    def __len__(self) -> int:
        return len(self.index)
