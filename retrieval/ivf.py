"""The approximate index kind: FAISS IVF-Flat over inner product, and reading rows back out.

An IVF index clusters the vectors into `nlist` lists around k-means centroids and searches
only the `nprobe` lists nearest the query, so a search scans about nprobe/nlist of the rows
(exact within those lists: vectors are stored uncompressed). It supports add and remove by
id (hash-table direct map), which HNSW in FAISS does not. `kvmosaic bench retrieval`
measures its recall@10 against the exact flat index.
"""

from __future__ import annotations

import math
from typing import cast

import faiss
import numpy as np
import numpy.typing as npt

# FAISS wants >= 39 training points per list; more only slows k-means down.
TRAIN_POINTS_PER_LIST = 64


def default_nlist(num_rows: int) -> int:
    """sqrt(N) lists (FAISS's guideline is 4-16 sqrt(N) for billion-row sets; at 1e5-1e6 rows
    sqrt(N) keeps the lists long enough that a few dozen probes reach high recall)."""
    return max(16, min(65536, int(math.sqrt(max(1, num_rows)))))


def train_ivf(
    vectors: npt.NDArray[np.float32], nlist: int, nprobe: int, seed: int = 0
) -> faiss.IndexIVFFlat:
    """An empty, trained IVF-Flat index for unit vectors [n, dim] (trains on a sample)."""
    dim = vectors.shape[1]
    sample = vectors
    limit = TRAIN_POINTS_PER_LIST * nlist
    if len(vectors) > limit:
        sample = vectors[np.random.default_rng(seed).choice(len(vectors), limit, replace=False)]
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    # the IVF index frees its quantizer (own_fields), not Python; `this` is SWIG's, not in faiss's
    # stub
    quantizer.this.disown()  # type: ignore[attr-defined]
    index.own_fields = True
    index.cp.seed = seed
    index.train(np.ascontiguousarray(sample, dtype=np.float32))
    # remove_ids / reconstruct by id; faiss's stub lacks DirectMap
    index.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
    index.nprobe = nprobe
    return index


def is_ivf(index: faiss.Index) -> bool:
    return isinstance(faiss.downcast_index(index), faiss.IndexIVF)


def rows(index: faiss.Index) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """(ids [n] int64, vectors [n, dim] float32) of a flat IDMap2 or IVF-Flat index."""
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexIVF):
        return _ivf_rows(index)
    flat = cast(faiss.IndexIDMap2, index)  # not IVF: the flat kind, IDMap2 over IndexFlatIP
    ids = faiss.vector_to_array(flat.id_map).astype(np.int64)
    vectors = (
        flat.index.reconstruct_n(0, flat.ntotal)
        if flat.ntotal
        else np.zeros((0, flat.d), np.float32)
    )
    return ids, np.asarray(vectors, dtype=np.float32).reshape(-1, flat.d)


def ids_of(index: faiss.Index) -> npt.NDArray[np.int64]:
    """The ids held by a flat IDMap2 or IVF index, int64, in storage order."""
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexIVF):
        lists = _lists(index)
        parts = [
            faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy()
            for i in range(index.nlist)
            if lists.list_size(i)
        ]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return faiss.vector_to_array(cast(faiss.IndexIDMap2, index).id_map).astype(np.int64)


def _ivf_rows(index: faiss.IndexIVF) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Rows of an IVF-Flat index: its codes are the vectors, uncompressed."""
    lists, dim = _lists(index), index.d
    ids: list[npt.NDArray[np.int64]] = []
    codes: list[npt.NDArray[np.uint8]] = []
    for i in range(index.nlist):
        size = lists.list_size(i)
        if size:
            ids.append(faiss.rev_swig_ptr(lists.get_ids(i), size).copy())
            codes.append(faiss.rev_swig_ptr(lists.get_codes(i), size * lists.code_size).copy())
    if not ids:
        return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
    return np.concatenate(ids).astype(np.int64), np.concatenate(codes).view(np.float32).reshape(
        -1, dim
    )


def _lists(index: faiss.IndexIVF) -> faiss.InvertedLists:
    lists = index.invlists
    if lists is None:  # never for an index built by `train_ivf` or read back from disk
        raise ValueError("the IVF index has no inverted lists")
    return lists
