"""The retriever: embed a question, search the index; keep the index in step with the chunks.

The chunks' source of truth is the caller's (the catalog): `open` loads the persisted index
when it holds exactly the caller's chunk ids under this embedder, and otherwise rebuilds it
from (id, text[, stored vector]) rows the caller supplies (a row without a usable vector is
embedded). Afterwards the caller feeds it the catalog's changes (`apply`), remembering how
far it got in `cursor`. Knows nothing about documents or the catalog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from retrieval.embedder import Embedder
from retrieval.index import Hit, IndexConfig, VectorIndex

log = logging.getLogger(__name__)

# (chunk id, text) or (chunk id, text, vector or None) rows, produced lazily: only read when a
# rebuild is needed. A vector given must be this embedder's, unit length, [dim].
ChunkRow = tuple[int, str] | tuple[int, str, npt.NDArray[np.float32] | None]
ChunkTexts = Callable[[], Iterable[ChunkRow]]


@dataclass(frozen=True)
class IndexUpdate:
    """One change to apply: chunk `chunk_id` enters retrieval with `vector` ([dim], unit), or
    leaves it (`vector` None). `seq` is the change's position in the caller's log."""

    seq: int
    chunk_id: int
    vector: npt.NDArray[np.float32] | None


class Retriever:
    """Thread-safe. Changes are persisted by `save` (the ingest step calls it per document).

    `cursor`: the position in the caller's change log up to which `apply` has brought the
    index (the caller sets it when it opens the index, `apply` advances it).
    """

    def __init__(
        self,
        embedder: Embedder,
        index: VectorIndex,
        directory: Path | None = None,
        config: IndexConfig = IndexConfig(),
    ):
        self.embedder = embedder
        self.index = index
        self.directory = directory
        self.config = config
        self.cursor = 0
        self._saved_cursor: int | None = None
        self._save_lock = threading.Lock()
        # Reentrant: a change-log follower holds it across reading changes and `apply`.
        self._apply_lock = threading.RLock()

    @classmethod
    def open(
        cls,
        embedder: Embedder,
        directory: Path,
        chunk_ids: Iterable[int],
        chunk_texts: ChunkTexts,
        batch_size: int = 256,
        config: IndexConfig = IndexConfig(),
    ) -> Retriever:
        """Load the saved index if it is fresh for `chunk_ids`; else rebuild and save it."""
        ids = list(chunk_ids)
        index = VectorIndex.load(directory, embedder.dim, embedder.name, ids, config)
        retriever = cls(
            embedder,
            index or VectorIndex(embedder.dim, embedder.name, config=config),
            directory,
            config,
        )
        if index is None:
            retriever.rebuild(chunk_texts(), batch_size)
        return retriever

    def rebuild(self, rows: Iterable[ChunkRow], batch_size: int = 256) -> int:
        """Replace the whole index with `rows` (stored vectors used, missing ones embedded);
        returns the number of rows."""
        started = time.perf_counter()
        fresh = VectorIndex(self.embedder.dim, self.embedder.name, config=self.config)
        batch: list[ChunkRow] = []
        for row in rows:
            batch.append(row)
            if len(batch) == batch_size:
                fresh.add([r[0] for r in batch], self._vectors(batch))
                batch.clear()
        if batch:
            fresh.add([r[0] for r in batch], self._vectors(batch))
        self.index = fresh
        self.save()
        log.info(
            "rebuilt the vector index: %d chunks in %.1f s",
            len(fresh),
            time.perf_counter() - started,
        )
        return len(fresh)

    def _vectors(self, rows: Sequence[ChunkRow]) -> npt.NDArray[np.float32]:
        """[len(rows), dim]: each row's stored vector, or its text embedded (in one batch)."""
        out = np.zeros((len(rows), self.embedder.dim), dtype=np.float32)
        stored = [r[2] if len(r) == 3 else None for r in rows]
        missing = [i for i, vector in enumerate(stored) if vector is None]
        for i, vector in enumerate(stored):
            if vector is not None:
                out[i] = vector
        if missing:
            out[missing] = self.embedder.encode([rows[i][1] for i in missing])
        return out

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        return self.embedder.encode(texts)

    def updating(self) -> AbstractContextManager[bool]:
        """Hold while a change is read and applied, or while rows are removed and their source
        deleted, so the two never interleave: a follower that read a chunk's add before a delete
        would otherwise apply it after the delete's removal and bring the chunk back until its
        next poll (seen as a flaky `test_add_list_show_and_delete`)."""
        return self._apply_lock

    def apply(self, updates: Sequence[IndexUpdate]) -> int:
        """Apply changes in order (adds replace, removes of unknown ids are no-ops, so applying
        a change twice is harmless) and advance `cursor`; returns how many were applied."""
        with self._apply_lock:
            for run in _runs(updates):  # consecutive adds (or removes) in one call each
                ids = [u.chunk_id for u in run]
                vectors = [u.vector for u in run if u.vector is not None]  # all or none (`_runs`)
                if not vectors:
                    self.index.remove(ids)
                else:
                    self.index.add(ids, np.stack(vectors))
                self.cursor = max(self.cursor, run[-1].seq)
        return len(updates)

    def add(self, ids: Sequence[int], vectors: npt.NDArray[np.float32]) -> None:
        self.index.add(ids, vectors)

    def remove(self, ids: Sequence[int]) -> int:
        return self.index.remove(ids)

    def search(self, question: str, k: int) -> list[Hit]:
        """The k chunks closest to the question, best first."""
        return self.index.search(self.embedder.encode([question])[0], k)

    def search_vector(self, vector: npt.NDArray[np.float32], k: int) -> list[Hit]:
        """The k chunks closest to an embedding of this retriever's embedder, best first."""
        return self.index.search(vector, k)

    def save(self) -> None:
        if self.directory is not None:
            with self._save_lock:
                cursor = self.cursor
                self.index.save(self.directory)
                self._saved_cursor = cursor

    def save_if_behind(self) -> bool:
        """Save if `apply` moved the cursor since the last save; True if it saved."""
        if self._saved_cursor == self.cursor:
            return False
        self.save()
        return True

    def __len__(self) -> int:
        return len(self.index)


def _runs(updates: Sequence[IndexUpdate]) -> list[list[IndexUpdate]]:
    """Split into maximal runs of adds or removes with distinct ids, keeping the order."""
    runs: list[list[IndexUpdate]] = []
    for update in updates:
        last = runs[-1] if runs else None
        if (
            last is not None
            and (last[0].vector is None) == (update.vector is None)
            and all(u.chunk_id != update.chunk_id for u in last)
        ):
            last.append(update)
        else:
            runs.append([update])
    return runs
