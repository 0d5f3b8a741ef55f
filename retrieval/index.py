"""A FAISS inner-product index over normalised embeddings, keyed by integer chunk ids.

Exact (flat) up to `IndexConfig.approx_above` rows; beyond, approximate (IVF-Flat, see
`retrieval/ivf.py`), retrained when the rows grow `regrow` times past the size it was
trained for. The k-means training runs outside the lock on a snapshot, so searches go on
meanwhile; only the final assignment of the rows to lists blocks them.

Persisted as two files in a directory: `vectors.faiss` (the index) and `manifest.json`
(embedder name, dimension, number of rows and a digest of the ids). `load` returns None when
the files are missing, unreadable or do not match what the caller expects; the caller then
rebuilds from its source of truth (the catalog). Writes are atomic (temp file + rename): a
write that fails (no space, a read-only volume) leaves the files as they were and removes its
temp file, and `load` removes temp files whose writer died. A failed `save` does not raise:
the index in memory is whole and a stale file is rebuilt at the next load, so the failure is
kept in `write_error` (logged once, cleared by the next save that works) for the caller's
health report.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import numpy.typing as npt

from retrieval import ivf

log = logging.getLogger(__name__)

INDEX_FILE = "vectors.faiss"
MANIFEST_FILE = "manifest.json"
# `_atomic_write`'s temp files: .<name>.<pid>.<thread id>.tmp
TEMP_FILE = re.compile(r"^\.(?:vectors\.faiss|manifest\.json)\.(\d+)\.\d+\.tmp$")


@dataclass(frozen=True)
class Hit:
    """A search result: chunk id and cosine similarity (higher is closer)."""

    chunk_id: int
    score: float


@dataclass(frozen=True)
class IndexConfig:
    """How the index scales (env names the app maps them from in brackets).

    approx_above: rows above which the exact flat index becomes IVF; 0 = always exact
      [KVMOSAIC_INDEX_APPROX_ABOVE].
    nprobe: IVF lists searched per query (more: higher recall, slower) [KVMOSAIC_INDEX_NPROBE].
    regrow: retrain the IVF lists once the rows are this many times the trained size.
    """

    approx_above: int = 100_000
    nprobe: int = 64  # recall@10 ~0.98 at 1e5 rows with sqrt(N) lists (kvmosaic bench retrieval)
    regrow: float = 4.0

    def __post_init__(self) -> None:
        if self.approx_above < 0 or self.nprobe < 1 or self.regrow <= 1:
            raise ValueError("approx_above must be >= 0, nprobe >= 1 and regrow > 1")


def ids_digest(ids: Iterable[int]) -> str:
    """Order-free digest of a set of ids: two indexes over the same chunks agree."""
    joined = ",".join(str(i) for i in sorted(int(i) for i in ids))
    return hashlib.sha256(joined.encode()).hexdigest()[:16]


class VectorIndex:
    """Thread-safe add / remove / search over (id, unit vector) rows."""

    def __init__(
        self,
        dim: int,
        embedder_name: str,
        index: faiss.Index | None = None,
        config: IndexConfig = IndexConfig(),
    ):
        self.dim = dim
        self.embedder_name = embedder_name
        self.config = config
        self._index = index if index is not None else _flat(dim)
        self._trained_rows = int(self._index.ntotal)
        self._lock = threading.Lock()
        self._training = False
        # why the last save failed (None: it worked, or none failed yet) and how many did
        self.write_error: str | None = None
        self.write_failures = 0
        ivf_index = faiss.downcast_index(self._index)
        if isinstance(ivf_index, faiss.IndexIVF):
            ivf_index.nprobe = config.nprobe

    def __len__(self) -> int:
        return int(self._index.ntotal)

    @property
    def approximate(self) -> bool:
        """True once the index is IVF (searches may miss a true neighbour; see the bench)."""
        return ivf.is_ivf(self._index)

    def ids(self) -> list[int]:
        with self._lock:
            return [int(i) for i in ivf.ids_of(self._index)]

    def add(self, ids: Sequence[int], vectors: npt.NDArray[np.float32]) -> None:
        """Add rows; vectors [len(ids), dim] should be unit length. Re-adding an id replaces it."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(ids), self.dim)
        id_array = np.asarray(ids, dtype=np.int64)
        one_faiss_thread()
        with self._lock:
            # faiss's stub types remove_ids(IDSelector); its Python wrapper takes an id array
            self._index.remove_ids(id_array)  # type: ignore[arg-type]
            self._index.add_with_ids(vectors, id_array)
        self._reshape_if_grown()

    def remove(self, ids: Sequence[int]) -> int:
        """Remove rows by id; unknown ids are ignored. Returns how many rows went."""
        if not len(ids):
            return 0
        one_faiss_thread()
        with self._lock:
            id_array = np.asarray(ids, dtype=np.int64)
            return int(self._index.remove_ids(id_array))  # type: ignore[arg-type]  # an id array, as in `add`

    def _reshape_if_grown(self) -> None:
        """Switch to IVF past `approx_above` rows, or retrain it past `regrow` x its trained
        size."""
        with self._lock:
            rows, limit = int(self._index.ntotal), self.config.approx_above
            grown = (
                rows > limit
                if not self.approximate
                else rows > self.config.regrow * self._trained_rows
            )
            if not limit or not grown or self._training:
                return
            self._training = True
            _, sample = ivf.rows(self._index)
        try:
            started = time.perf_counter()
            one_faiss_thread()
            trained = ivf.train_ivf(sample, ivf.default_nlist(len(sample)), self.config.nprobe)
            del sample
            with self._lock:  # the rows as they are now, changes during training included
                ids, vectors = ivf.rows(self._index)
                trained.add_with_ids(vectors, ids)
                self._index, self._trained_rows = trained, len(ids)
            log.info(
                "vector index: %d rows now in IVF with %d lists (%.1f s)",
                len(ids),
                trained.nlist,
                time.perf_counter() - started,
            )
        finally:
            self._training = False

    def search(self, vector: npt.NDArray[np.float32], k: int) -> list[Hit]:
        """The k nearest rows to one query vector [dim], best first (fewer if the index is
        small)."""
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dim)
        one_faiss_thread()
        with self._lock:
            if self._index.ntotal == 0 or k < 1:
                return []
            scores, ids = self._index.search(query, min(k, int(self._index.ntotal)))
        return [Hit(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    # -- persistence ---------------------------------------------------------------------------

    def save(self, directory: Path) -> bool:
        """Write the index and its manifest; True if both were written. False if the volume
        refused (OSError: no space, read-only, I/O error): the files stay as they were, no
        temp file is left, and `write_error` says why until a save works again."""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with self._lock:
                ids = [int(i) for i in ivf.ids_of(self._index)]
                data = faiss.serialize_index(self._index).tobytes()
                trained = self._trained_rows
            _atomic_write(directory / INDEX_FILE, data)
            manifest = {
                "embedder": self.embedder_name,
                "dim": self.dim,
                "rows": len(ids),
                "ids": ids_digest(ids),
                "trained_rows": trained,
            }
            _atomic_write(directory / MANIFEST_FILE, json.dumps(manifest).encode())
        except OSError as exc:
            self._save_failed(directory, exc)
            return False
        if self.write_error is not None:
            log.warning("vector index at %s saved again", directory)
            self.write_error = None
        return True

    def _save_failed(self, directory: Path, exc: OSError) -> None:
        self.write_failures += 1
        if self.write_error is None:
            log.error(
                "vector index at %s cannot be saved (%s); it is served from memory and "
                "rebuilt from the catalog at the next start if still stale",
                directory,
                exc,
            )
        self.write_error = str(exc)

    @classmethod
    def load(
        cls,
        directory: Path,
        dim: int,
        embedder_name: str,
        expected_ids: Iterable[int],
        config: IndexConfig = IndexConfig(),
    ) -> VectorIndex | None:
        """The saved index if it holds exactly `expected_ids` under this embedder; else None.

        A saved IVF index is used only while `config` still wants one (`approx_above`).
        Temp files of writers that died are removed first (`remove_stale_temp_files`)."""
        remove_stale_temp_files(directory)
        try:
            manifest = json.loads((directory / MANIFEST_FILE).read_text())
            raw = np.frombuffer((directory / INDEX_FILE).read_bytes(), dtype=np.uint8)
            index = faiss.deserialize_index(raw)
        except (OSError, ValueError, RuntimeError) as exc:
            log.info("vector index at %s not usable (%s); it will be rebuilt", directory, exc)
            return None
        loaded = cls(dim, embedder_name, index, config)
        loaded._trained_rows = int(manifest.get("trained_rows") or len(loaded))
        fresh = (
            manifest.get("embedder") == embedder_name
            and manifest.get("dim") == dim
            and index.d == dim
            and ids_digest(loaded.ids()) == ids_digest(expected_ids)
            and (not loaded.approximate or config.approx_above > 0)
        )
        if not fresh:
            log.info("vector index at %s is stale; it will be rebuilt", directory)
        return loaded if fresh else None


def one_faiss_thread() -> None:
    """Make FAISS run on the calling thread alone from now on. libgomp gives every thread that
    has not chosen a count all the cores, and the pool a parallel FAISS call leaves behind slows
    the engine's compute thread for as long as this thread lives (engine/serving/threads.py); one
    query
    or a batch of added rows is small work, and the index is searched under a lock anyway."""
    faiss.omp_set_num_threads(1)  # this thread's OpenMP count only


def _flat(dim: int) -> faiss.Index:
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))


def remove_stale_temp_files(directory: Path) -> int:
    """Remove the temp files of `_atomic_write`s whose process is gone (a crash, or an old
    version that left them on a failed write); a live process's are its writes in progress
    (a `kvmosaic ingest` next to the server). Returns how many went."""
    removed = 0
    try:
        names = [p for p in directory.iterdir() if TEMP_FILE.match(p.name)]
    except OSError:  # no directory yet
        return 0
    for path in names:
        match = TEMP_FILE.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    if removed:
        log.warning("removed %d temp files of interrupted index writes in %s", removed, directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:  # EPERM: it exists, under another user
        return exc.errno == errno.EPERM
    return True


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory, synced, then renamed
    over it; on any failure the temp file is removed and `path` is untouched."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
