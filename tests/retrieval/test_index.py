"""The FAISS index searches by cosine, removes by id, and persists only while it is fresh."""

from __future__ import annotations

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


@pytest.mark.parametrize("dim,name,ids", [(3, "other-embedder", [10, 20, 30]), (3, "test-embedder", [10, 20]),
                                          (4, "test-embedder", [10, 20, 30])])
def test_stale_index_is_not_loaded(index, tmp_path, dim, name, ids):
    index.save(tmp_path)
    assert VectorIndex.load(tmp_path, dim, name, ids) is None


def test_missing_or_corrupt_index_is_not_loaded(index, tmp_path):
    assert VectorIndex.load(tmp_path, 3, "test-embedder", []) is None
    index.save(tmp_path)
    (tmp_path / INDEX_FILE).write_bytes(b"garbage")
    assert VectorIndex.load(tmp_path, 3, "test-embedder", [10, 20, 30]) is None
