"""A FAISS inner-product index over normalised embeddings, keyed by integer chunk ids.

Persisted as two files in a directory: `vectors.faiss` (the index) and `manifest.json`
(embedder name, dimension, number of rows and a digest of the ids). `load` returns None when
the files are missing, unreadable or do not match what the caller expects; the caller then
rebuilds from its source of truth (the catalog). Writes are atomic (temp file + rename).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

log = logging.getLogger(__name__)

INDEX_FILE = "vectors.faiss"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Hit:
    """A search result: chunk id and cosine similarity (higher is closer)."""

    chunk_id: int
    score: float


def ids_digest(ids: Iterable[int]) -> str:
    """Order-free digest of a set of ids: two indexes over the same chunks agree."""
    joined = ",".join(str(i) for i in sorted(int(i) for i in ids))
    return hashlib.sha256(joined.encode()).hexdigest()[:16]


class VectorIndex:
    """Thread-safe add / remove / search over (id, unit vector) rows."""

    def __init__(self, dim: int, embedder_name: str, index: faiss.Index | None = None):
        self.dim = dim
        self.embedder_name = embedder_name
        self._index = index if index is not None else faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def ids(self) -> list[int]:
        with self._lock:
            return [int(i) for i in faiss.vector_to_array(self._index.id_map)]

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        """Add rows; vectors [len(ids), dim] should be unit length. Re-adding an id replaces it."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(ids), self.dim)
        id_array = np.asarray(ids, dtype=np.int64)
        with self._lock:
            self._index.remove_ids(id_array)
            self._index.add_with_ids(vectors, id_array)

    def remove(self, ids: Sequence[int]) -> int:
        """Remove rows by id; unknown ids are ignored. Returns how many rows went."""
        if not len(ids):
            return 0
        with self._lock:
            return int(self._index.remove_ids(np.asarray(ids, dtype=np.int64)))

    def search(self, vector: np.ndarray, k: int) -> list[Hit]:
        """The k nearest rows to one query vector [dim], best first (fewer if the index is small)."""
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dim)
        with self._lock:
            if self._index.ntotal == 0 or k < 1:
                return []
            scores, ids = self._index.search(query, min(k, int(self._index.ntotal)))
        return [Hit(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    # -- persistence ---------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            ids = [int(i) for i in faiss.vector_to_array(self._index.id_map)]
            _atomic_write(directory / INDEX_FILE, faiss.serialize_index(self._index).tobytes())
        manifest = {"embedder": self.embedder_name, "dim": self.dim, "rows": len(ids), "ids": ids_digest(ids)}
        _atomic_write(directory / MANIFEST_FILE, json.dumps(manifest).encode())

    @classmethod
    def load(cls, directory: Path, dim: int, embedder_name: str, expected_ids: Iterable[int]) -> "VectorIndex | None":
        """The saved index if it holds exactly `expected_ids` under this embedder; else None."""
        try:
            manifest = json.loads((directory / MANIFEST_FILE).read_text())
            raw = np.frombuffer((directory / INDEX_FILE).read_bytes(), dtype=np.uint8)
            index = faiss.deserialize_index(raw)
        except (OSError, ValueError, RuntimeError) as exc:
            log.info("vector index at %s not usable (%s); it will be rebuilt", directory, exc)
            return None
        loaded = cls(dim, embedder_name, index)
        fresh = (manifest.get("embedder") == embedder_name and manifest.get("dim") == dim
                 and index.d == dim and ids_digest(loaded.ids()) == ids_digest(expected_ids))
        if not fresh:
            log.info("vector index at %s is stale; it will be rebuilt", directory)
        return loaded if fresh else None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
