"""The FAISS index searches by cosine, removes by id, and persists only while it is fresh."""

from __future__ import annotations

import os

import numpy as np
import pytest

from retrieval.index import INDEX_FILE, VectorIndex


def unit(*values: float) -> np.ndarray:
    v = np.asarray(values, dtype=np.float32)
    return v / np.linalg.norm(v)


@pytest.fixture
def index() -> VectorIndex:
    ix = VectorIndex(3, "test-embedder")
    ix.add([10, 20, 30], np.stack([unit(1, 0, 0), unit(0, 1, 0), unit(1, 1, 0)]))
    return ix


def test_search_returns_nearest_first(index):
    hits = index.search(unit(1, 0.1, 0), 2)
    assert [h.chunk_id for h in hits] == [10, 30]
    assert hits[0].score == pytest.approx(float(unit(1, 0.1, 0) @ unit(1, 0, 0)), abs=1e-6)


def test_k_larger_than_index_and_empty_index():
    assert VectorIndex(3, "e").search(unit(1, 0, 0), 5) == []


def test_remove_and_replace(index):
    assert index.remove([20, 99]) == 1
    index.add([10], unit(0, 0, 1)[None])
    assert sorted(index.ids()) == [10, 30] and len(index) == 2
    assert index.search(unit(0, 0, 1), 1)[0].chunk_id == 10


def test_save_and_load_round_trip(index, tmp_path):
    index.save(tmp_path)
    loaded = VectorIndex.load(tmp_path, 3, "test-embedder", [30, 20, 10])
    assert loaded is not None
    assert [h.chunk_id for h in loaded.search(unit(0, 1, 0), 1)] == [20]


@pytest.mark.parametrize(
    "dim,name,ids",
    [
        (3, "other-embedder", [10, 20, 30]),
        (3, "test-embedder", [10, 20]),
        (4, "test-embedder", [10, 20, 30]),
    ],
)
def test_stale_index_is_not_loaded(index, tmp_path, dim, name, ids):
    index.save(tmp_path)
    assert VectorIndex.load(tmp_path, dim, name, ids) is None


def test_missing_or_corrupt_index_is_not_loaded(index, tmp_path):
    assert VectorIndex.load(tmp_path, 3, "test-embedder", []) is None
    index.save(tmp_path)
    (tmp_path / INDEX_FILE).write_bytes(b"garbage")
    assert VectorIndex.load(tmp_path, 3, "test-embedder", [10, 20, 30]) is None


def clustered(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(32, dim))
    x = centers[rng.integers(0, 32, n)] + 0.3 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_grows_into_ivf_past_the_threshold_and_keeps_working(tmp_path):
    from retrieval.index import IndexConfig

    config = IndexConfig(approx_above=2000, nprobe=8)
    vectors = clustered(3000)
    index = VectorIndex(16, "e", config=config)
    index.add(list(range(1500)), vectors[:1500])
    assert not index.approximate
    index.add(list(range(1500, 3000)), vectors[1500:])
    assert index.approximate and len(index) == 3000 and sorted(index.ids()) == list(range(3000))
    assert index.search(vectors[2500], 1)[0].chunk_id == 2500  # a stored vector finds itself
    assert index.remove([2500, 99999]) == 1 and 2500 not in {
        h.chunk_id for h in index.search(vectors[2500], 5)
    }
    index.add([7], vectors[8][None])  # replace
    assert index.search(vectors[8], 2)[0].chunk_id in (7, 8) and len(index) == 2999
    index.save(tmp_path)
    loaded = VectorIndex.load(tmp_path, 16, "e", index.ids(), config)
    assert loaded.approximate and loaded.search(vectors[100], 1)[0].chunk_id == 100
    assert VectorIndex.load(tmp_path, 16, "e", index.ids(), IndexConfig(approx_above=0)) is None


def test_zero_threshold_stays_exact():
    from retrieval.index import IndexConfig

    index = VectorIndex(16, "e", config=IndexConfig(approx_above=0))
    index.add(list(range(500)), clustered(500))
    assert not index.approximate


def test_retriever_applies_changes_in_order():
    from retrieval.retriever import IndexUpdate, Retriever

    class Fake:
        dim, name = 3, "e"

        def encode(self, texts):
            return np.stack([unit(1, 0, 0) for _ in texts])

    retriever = Retriever(Fake(), VectorIndex(3, "e"))
    updates = [
        IndexUpdate(1, 10, unit(1, 0, 0)),
        IndexUpdate(2, 20, unit(0, 1, 0)),
        IndexUpdate(3, 10, None),
        IndexUpdate(4, 10, unit(0, 0, 1)),
        IndexUpdate(5, 30, None),
    ]
    assert retriever.apply(updates) == 5 and retriever.cursor == 5
    assert sorted(retriever.index.ids()) == [10, 20]
    assert retriever.index.search(unit(0, 0, 1), 1)[0].chunk_id == 10
    assert retriever.rebuild([(1, "a", unit(0, 1, 0)), (2, "b"), (3, "c", None)]) == 3
    assert retriever.index.search(unit(0, 1, 0), 1)[0].chunk_id == 1


def test_index_operations_leave_the_calling_thread_on_one_faiss_thread(index):
    """A thread that searches, adds or removes must not keep a FAISS pool of all the cores
    (it would slow the engine's compute thread, engine/serving/threads.py)."""
    import threading

    import faiss

    counts = {}

    def fresh_thread(name, operation):
        def run():
            counts[f"{name} before"] = faiss.omp_get_max_threads()
            operation()
            counts[name] = faiss.omp_get_max_threads()

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()

    vector = np.eye(index.dim, dtype=np.float32)[0]
    fresh_thread("search", lambda: index.search(vector, 2))
    fresh_thread("add", lambda: index.add([999], vector[None]))
    fresh_thread("remove", lambda: index.remove([999]))
    assert {counts[op] for op in ("search", "add", "remove")} == {1}
    # a new thread's own default
    if len(os.sched_getaffinity(0)) > 1 and "OMP_NUM_THREADS" not in os.environ:
        assert counts["search before"] > 1


# -- a volume that refuses writes (issue #50) -----------------------------------------------


def files_of(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_a_save_onto_a_full_volume_leaves_the_files_as_they_were_and_no_temp_file(index, tmp_path):
    """A 6 MiB tmpfs, filled: the save fails, says why, leaves the last good files and no
    `.vectors.faiss.*.tmp`; once space is freed the next save works and clears the error."""
    from tests.app.volumes import fill, small_volume

    with small_volume(tmp_path / "volume") as volume:
        directory = volume / "index"
        assert index.save(directory) and index.write_error is None
        before = files_of(directory)
        index.add([40], clustered(1, dim=3))  # the next save has something new to write
        filler = fill(volume)
        assert index.save(directory) is False
        assert "No space left on device" in index.write_error and index.write_failures == 1
        assert files_of(directory) == before  # no temp file, the old index intact
        assert VectorIndex.load(directory, 3, "test-embedder", [10, 20, 30]) is not None
        filler.unlink()
        assert index.save(directory) and index.write_error is None
        assert VectorIndex.load(directory, 3, "test-embedder", [10, 20, 30, 40]) is not None
        assert sorted(files_of(directory)) == sorted([INDEX_FILE, "manifest.json"])


@pytest.mark.parametrize("fails_at", ["write", "fsync", "replace"])
def test_a_failed_write_removes_its_temp_file_wherever_it_fails(
    index, tmp_path, monkeypatch, fails_at
):
    """The same without a mount: each step of the atomic write raising ENOSPC."""
    import errno

    import retrieval.index as index_module

    index.save(tmp_path)
    before = files_of(tmp_path)
    index.add([40], clustered(1, dim=3))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if fails_at == "write":
        monkeypatch.setattr(index_module, "open", lambda path, mode: _FullFile(path), raising=False)
    else:
        monkeypatch.setattr(index_module.os, fails_at, full)
    assert index.save(tmp_path) is False and "No space" in index.write_error
    monkeypatch.undo()
    assert files_of(tmp_path) == before
    assert index.save(tmp_path) and index.write_error is None and index.write_failures == 1


class _FullFile:
    """A file whose write stores part of the data, then fails (as on a full disk)."""

    def __init__(self, path):
        self._fh = open(path, "wb")  # noqa: SIM115 (closed in __exit__)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()

    def write(self, data):
        import errno

        self._fh.write(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_load_removes_temp_files_whose_writer_is_gone(index, tmp_path):
    """What a crash (or an older version's failed write) left is removed at start-up; a live
    process's write in progress is not touched."""
    import subprocess
    import sys

    index.save(tmp_path)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(gone.stdout)
    stale = [
        tmp_path / f".vectors.faiss.{dead}.1234.tmp",
        tmp_path / f".manifest.json.{dead}.1.tmp",
    ]
    live = tmp_path / f".vectors.faiss.{os.getpid()}.5678.tmp"
    for path in (*stale, live):
        path.write_bytes(b"")
    assert VectorIndex.load(tmp_path, 3, "test-embedder", [10, 20, 30]) is not None
    assert not any(p.exists() for p in stale) and live.exists()
