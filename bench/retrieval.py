"""`kvmosaic bench retrieval`: search latency and recall@10 of the approximate index (IVF)
against the exact flat index, at several sizes of synthetic embeddings.

Synthetic vectors lie near a random `latent`-dimensional subspace of the `dim`-dimensional
space (Gaussian latent points mapped by a random matrix, plus isotropic noise, normalised):
sentence embeddings have a low intrinsic dimension, and at the defaults a query's nearest
neighbour has cosine ~0.7 and its 10th ~0.6, as for MiniLM over a corpus. Uniform random
vectors would have no neighbourhood structure; well-separated clusters would make every
index look perfect. Queries are fresh points of the same distribution. recall@10 = the share of the
flat index's
10 nearest rows that IVF also returns in its top 10, averaged over the queries. Latency is
per single-query search (what `/ask` does), one thread, median and p99 over the queries.
Memory is what each index holds: vectors (N x dim x 4 bytes) plus ids, and IVF's centroids.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np
import numpy.typing as npt

from retrieval import ivf

K = 10


@dataclass(frozen=True)
class RetrievalBenchOptions:
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    dim: int = 384  # MiniLM's
    queries: int = 200
    nprobe: int = 64
    latent: int = 24
    noise: float = 0.3
    seed: int = 0


@dataclass(frozen=True)
class RetrievalRow:
    size: int
    nlist: int
    nprobe: int
    flat_ms_p50: float
    flat_ms_p99: float
    ivf_ms_p50: float
    ivf_ms_p99: float
    speedup: float  # flat p50 / IVF p50, measured in the same run
    recall_at_10: float
    flat_mib: float
    ivf_mib: float
    build_s: float  # IVF training + adding every row


def synthetic(
    n: int, options: RetrievalBenchOptions, rng: np.random.Generator
) -> npt.NDArray[np.float32]:
    """[n, dim] float32 unit vectors near the latent subspace (its map drawn once per seed)."""
    mapping = (
        np.random.default_rng(options.seed)
        .normal(size=(options.latent, options.dim))
        .astype(np.float32)
    )
    scale = options.noise * np.sqrt(options.latent)  # noise relative to the signal's per-dim spread
    out = np.empty((n, options.dim), dtype=np.float32)
    for start in range(0, n, 100_000):  # bounded temporaries at 1e6
        m = min(100_000, n - start)
        block = rng.normal(size=(m, options.latent)).astype(np.float32) @ mapping
        block += scale * rng.normal(size=(m, options.dim)).astype(np.float32)
        out[start : start + m] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def run_retrieval_bench(
    options: RetrievalBenchOptions, log: Callable[[str], object] = print
) -> list[RetrievalRow]:
    faiss.omp_set_num_threads(1)  # one query at a time on one thread, as a request runs it
    rows = []
    for size in options.sizes:
        rng = np.random.default_rng(options.seed + size)
        vectors, queries = synthetic(size, options, rng), synthetic(options.queries, options, rng)
        rows.append(_measure(size, vectors, queries, options))
        log(format_row(rows[-1]))
        del vectors
    return rows


def _measure(
    size: int,
    vectors: npt.NDArray[np.float32],
    queries: npt.NDArray[np.float32],
    options: RetrievalBenchOptions,
) -> RetrievalRow:
    ids = np.arange(size, dtype=np.int64)
    flat = faiss.IndexIDMap2(faiss.IndexFlatIP(options.dim))
    flat.add_with_ids(vectors, ids)
    exact, flat_ms = _search_all(flat, queries)
    started = time.perf_counter()
    nlist = ivf.default_nlist(size)
    approx = ivf.train_ivf(vectors, nlist, options.nprobe, options.seed)
    approx.add_with_ids(vectors, ids)
    build_s = time.perf_counter() - started
    found, ivf_ms = _search_all(approx, queries)
    recall = float(np.mean([len(set(e) & set(f)) / K for e, f in zip(exact, found)]))
    vector_bytes = size * (options.dim * 4 + 8)
    return RetrievalRow(
        size,
        nlist,
        options.nprobe,
        _p(flat_ms, 50),
        _p(flat_ms, 99),
        _p(ivf_ms, 50),
        _p(ivf_ms, 99),
        _p(flat_ms, 50) / max(_p(ivf_ms, 50), 1e-9),
        recall,
        vector_bytes / 2**20,
        (vector_bytes + nlist * options.dim * 4) / 2**20,
        build_s,
    )


def _search_all(
    index: faiss.Index, queries: npt.NDArray[np.float32]
) -> tuple[list[list[int]], list[float]]:
    results, times = [], []
    for query in queries:
        started = time.perf_counter()
        _, ids = index.search(query[None], K)
        times.append((time.perf_counter() - started) * 1000)
        results.append([int(i) for i in ids[0] if i >= 0])
    return results, times


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


HEADER = (
    f"{'rows':>9} {'lists':>6} {'probe':>5} {'flat p50':>9} {'flat p99':>9} {'ivf p50':>8} "
    f"{'ivf p99':>8} "
    f"{'speedup':>7} {'recall@10':>9} {'flat MiB':>9} {'ivf MiB':>8} {'build s':>8}"
)


def format_row(r: RetrievalRow) -> str:
    return (
        f"{r.size:>9} {r.nlist:>6} {r.nprobe:>5} {r.flat_ms_p50:>7.2f}ms {r.flat_ms_p99:>7.2f}ms "
        f"{r.ivf_ms_p50:>6.2f}ms {r.ivf_ms_p99:>6.2f}ms {r.speedup:>6.1f}x {r.recall_at_10:>9.3f} "
        f"{r.flat_mib:>9.1f} {r.ivf_mib:>8.1f} {r.build_s:>8.1f}"
    )


def write_json(rows: list[RetrievalRow], options: RetrievalBenchOptions, path: Path) -> None:
    path.write_text(
        json.dumps({"options": asdict(options), "rows": [asdict(r) for r in rows]}, indent=2)
    )
