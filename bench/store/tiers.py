"""`kvmosaic bench store`: tier throughput against raw file I/O, and load/compute overlap.

Part 1 — for entries the size of a real chunk (SmolLM2, 512 tokens: [30, 2, 3, 512, 64])
and of 10 MiB ([20, 2, 2, 1024, 64]), in the storage dtype: put and get throughput of each
tier (whole entries, and layer by layer), each divided by the throughput of writing (with
fsync when the disk tier fsyncs) and reading back the same bytes as a plain file, measured
in the same run, in the same directory.

Part 2 — a blended request (`cacheblend`) over `chunks` chunks whose KV is on the disk tier
only and cold (evicted from the page cache): the share of KV load time hidden behind the
compute, 1 - (time the runner waited for layers) / (time spent reading them), clamped to
[0, 1] (`app.store.lazy.hidden_share` says why). It also reports TTFT against the same
request with every chunk's KV already in memory.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from app.store import EntryMeta, KVEntry, StoreConfig, TierUnavailable, create_tier
from app.store.lazy import hidden_share
from app.store.quant import get_codec
from engine.planners import Mode

SHAPES = {"chunk-512": (30, 2, 3, 512, 64), "10MiB": (20, 2, 2, 1024, 64)}
QUESTION = "Which of these passages mentions a date, and what happened then?"


@dataclass(frozen=True)
class StoreBenchOptions:
    tiers: tuple[str, ...] = ("gpu", "cpu", "disk", "redis")
    repeats: int = 5
    dtype: str = "float16"
    redis_url: str = "redis://127.0.0.1:6379/0"
    work_dir: Path | None = None
    fsync: bool = True
    chunks: int = 6
    chunk_tokens: int = 512
    blend_repeats: int = 3


@dataclass
class ThroughputRow:
    tier: str
    entry: str
    megabytes: float
    put_mb_s: float
    get_mb_s: float
    get_layers_mb_s: float
    raw_write_mb_s: float
    raw_read_mb_s: float

    @property
    def put_ratio(self) -> float:
        return self.put_mb_s / self.raw_write_mb_s

    @property
    def get_ratio(self) -> float:
        return self.get_mb_s / self.raw_read_mb_s


@dataclass
class OverlapResult:
    chunks: int
    chunk_tokens: int
    load_s: float
    wait_s: float
    hidden_share: float
    ttft_cold_disk_s: float
    ttft_in_memory_s: float
    samples: list[dict] = field(default_factory=list)


def make_entry(shape: tuple[int, ...], dtype: str, seed: int) -> KVEntry:
    """A random entry of KV `shape` [layers, 2, heads, tokens, dim] encoded by codec `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=generator)  # [layers, 2, heads, tokens, dim]
    meta = EntryMeta("bench", "bench", f"{seed:064x}", 0, dtype, tuple(shape))
    return KVEntry(meta, get_codec(dtype).encode(kv))


def format_codec_sizes(
    layers: int = 30, heads: int = 3, dim: int = 64, tokens: tuple[int, ...] = (256, 512)
) -> str:
    """Stored bytes per token of every codec for SmolLM2-shaped chunks, against float16."""
    from app.store.quant import CODECS

    lines = ["codec      " + " ".join(f"{f'B/token @{n}':>13} {'vs f16':>7}" for n in tokens)]
    for name, codec in CODECS.items():
        cells = []
        for n in tokens:
            size = layers * codec.layer_bytes((2, heads, n, dim)) / n
            cells.append(f"{size:>13.0f} {size / (layers * 2 * heads * dim * 2):>6.3f}x")
        lines.append(f"{name:<10} " + " ".join(cells))
    return "\n".join(lines)


def _mb_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / 1e6 / max(seconds, 1e-9)


def raw_file_throughput(
    directory: Path, payload: bytes, repeats: int, fsync: bool
) -> tuple[float, float]:
    """MB/s of writing `payload` to new files (fsync if asked) and of reading them back."""
    paths = [directory / f"raw-{i}.bin" for i in range(repeats)]
    started = time.perf_counter()
    for path in paths:
        with open(path, "wb") as f:
            f.write(payload)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    for path in paths:
        path.read_bytes()
    read_s = time.perf_counter() - started
    for path in paths:
        path.unlink()
    return _mb_s(len(payload) * repeats, write_s), _mb_s(len(payload) * repeats, read_s)


def tier_throughput(
    tier, name: str, shape, options: StoreBenchOptions, raw: tuple[float, float]
) -> ThroughputRow:
    entries = [make_entry(shape, options.dtype, seed) for seed in range(options.repeats)]
    keys = [f"{seed:032x}" for seed in range(options.repeats)]
    total = sum(e.num_bytes for e in entries)
    started = time.perf_counter()
    for key, entry in zip(keys, entries):
        tier.put(key, entry)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    for key in keys:
        tier.get(key)
    get_s = time.perf_counter() - started
    started = time.perf_counter()
    for key in keys:
        with tier.open(key) as reader:
            for index in range(reader.meta.num_layers):
                reader.layer(index)
    layers_s = time.perf_counter() - started
    for key in keys:
        tier.remove(key)
    return ThroughputRow(
        tier.name,
        name,
        entries[0].num_bytes / 1e6,
        _mb_s(total, put_s),
        _mb_s(total, get_s),
        _mb_s(total, layers_s),
        raw[0],
        raw[1],
    )


def run_throughput(options: StoreBenchOptions, work_dir: Path, log=print) -> list[ThroughputRow]:
    rows = []
    for name, shape in SHAPES.items():
        payload = make_entry(shape, options.dtype, 0).kv.view(torch.uint8).numpy().tobytes()
        raw = raw_file_throughput(work_dir, payload, options.repeats, options.fsync)
        for tier_name in options.tiers:
            config = StoreConfig(
                tiers=(tier_name,),
                disk_dir=work_dir / "kv",
                disk_fsync=options.fsync,
                redis_url=options.redis_url,
                redis_prefix="kvmosaic-bench:",
                codec=options.dtype,
            )
            try:
                tier = create_tier(tier_name, config)
            except TierUnavailable as exc:
                log(f"skipping tier {tier_name}: {exc}")
                continue
            try:
                rows.append(tier_throughput(tier, name, shape, options, raw))
            finally:
                tier.close()
    return rows


def format_throughput(rows: list[ThroughputRow]) -> str:
    lines = [
        f"{'tier':<6} {'entry':<10} {'MB':>6} {'put MB/s':>9} {'get MB/s':>9} {'layers MB/s':>11} "
        f"{'raw w MB/s':>10} {'raw r MB/s':>10} {'put/raw':>8} {'get/raw':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r.tier:<6} {r.entry:<10} {r.megabytes:>6.1f} {r.put_mb_s:>9.0f} {r.get_mb_s:>9.0f} "
            f"{r.get_layers_mb_s:>11.0f} {r.raw_write_mb_s:>10.0f} {r.raw_read_mb_s:>10.0f} "
            f"{r.put_ratio:>8.2f} {r.get_ratio:>8.2f}"
        )
    if any(r.tier in ("cpu", "gpu") for r in rows):
        lines.append(
            "(cpu/gpu get hands back the stored tensor without copying; 'layers' reads each layer "
            "view)"
        )
    return "\n".join(lines)


def write_json(
    rows: list[ThroughputRow],
    overlap: OverlapResult | None,
    options: StoreBenchOptions,
    path: Path,
    capacity=None,
) -> None:
    data = {
        "options": {k: str(v) for k, v in asdict(options).items()},
        "throughput": [dict(asdict(r), put_ratio=r.put_ratio, get_ratio=r.get_ratio) for r in rows],
        "overlap": asdict(overlap) if overlap else None,
        "capacity": asdict(capacity) if capacity else None,
    }
    Path(path).write_text(json.dumps(data, indent=2))


def default_work_dir(options: StoreBenchOptions) -> tempfile.TemporaryDirectory:
    base = options.work_dir
    if base is not None:
        Path(base).mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix="kvmosaic-bench-", dir=base)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- part 2: layer loading overlapped with compute -----------------------------------------------


def bench_chunk_refs(engine, catalog, options: StoreBenchOptions) -> list:
    """`options.chunks` distinct chunks of exactly `chunk_tokens` tokens, recorded in the
    catalog."""
    from app.catalog import NewChunk
    from app.kvcache.variants import ChunkRef
    from app.store import token_ids_hash

    texts, ids = [], []
    for i in range(options.chunks):
        words = [
            f"Record {i}-{j}: the station number {(j * 7919 + i * 104729) % 9973} opened in "
            f"{1800 + (j * 37 + i) % 220} near the river {chr(65 + (i + j) % 26)}."
            for j in range(200)
        ]
        text = " ".join(words)
        token_ids = engine.chunk_ids(text)[: options.chunk_tokens]
        if len(token_ids) < options.chunk_tokens:
            raise ValueError(f"synthetic chunk has only {len(token_ids)} tokens")
        texts.append(text)
        ids.append(token_ids)
    new = [NewChunk(t, len(i), token_ids_hash(i)) for t, i in zip(texts, ids)]
    added = catalog.add_document("bench", "bench", "0" * 64, new)
    return [ChunkRef(c.id, i) for c, i in zip(added.chunks, ids)]


def evict_page_cache(directory: Path) -> None:
    """Ask the kernel to drop the cached pages of every file under `directory` (they are clean)."""
    for path in Path(directory).rglob("*.kvs"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_overlap(engine, options: StoreBenchOptions, work_dir: Path) -> OverlapResult:
    from app.catalog import Catalog, CatalogConfig
    from app.kvcache.cache import ChunkKVCache
    from app.store import chunk_from_entry, create_store
    from engine.plan import ChunkInput

    catalog = Catalog.open(CatalogConfig(data_dir=work_dir))
    config = StoreConfig(
        tiers=("disk",),
        disk_dir=work_dir / "blend-kv",
        disk_fsync=options.fsync,
        codec=options.dtype,
    )
    cache = ChunkKVCache.open(engine, create_store(config), catalog, options.dtype)
    try:
        refs = bench_chunk_refs(engine, catalog, options)
        with cache.loader.load(refs):  # computes and stores every chunk (not timed)
            pass
        in_memory = [
            ChunkInput(
                r.chunk_id,
                r.token_ids,
                chunk_from_entry(
                    cache.store.get(cache.keys.key(r.token_ids)),
                    r.token_ids,
                    engine.loaded.dtype,
                    engine.device,
                ),
            )
            for r in refs
        ]
        engine.prefill(in_memory, QUESTION, Mode.named("cacheblend"))  # warm-up
        samples = [
            _overlap_sample(engine, cache, refs, in_memory, config.disk_dir)
            for _ in range(options.blend_repeats)
        ]
    finally:
        cache.store.close()
        catalog.close()
    load_s, wait_s = sum(s["load_s"] for s in samples), sum(s["wait_s"] for s in samples)
    return OverlapResult(
        options.chunks,
        options.chunk_tokens,
        load_s,
        wait_s,
        hidden_share(load_s, wait_s),
        median([s["ttft_cold_disk_s"] for s in samples]),
        median([s["ttft_in_memory_s"] for s in samples]),
        samples,
    )


def _overlap_sample(engine, cache, refs, in_memory, disk_dir: Path) -> dict:
    evict_page_cache(disk_dir)
    started = time.perf_counter()
    with cache.loader.load(refs) as loaded:
        engine.prefill(loaded.inputs, QUESTION, Mode.named("cacheblend"))
        ttft_cold = time.perf_counter() - started
        stats = loaded.load_stats()
        if loaded.computed:
            raise RuntimeError(f"chunks {loaded.computed} were recomputed, not loaded")
    ttft_memory = engine.prefill(in_memory, QUESTION, Mode.named("cacheblend")).ttft_s
    return {
        "load_s": stats.load_s,
        "wait_s": stats.wait_s,
        "layers_read": stats.layers_read,
        "layers_wasted": stats.layers_wasted,
        "hidden_share": hidden_share(stats.load_s, stats.wait_s),
        "ttft_cold_disk_s": ttft_cold,
        "ttft_in_memory_s": ttft_memory,
    }


def format_overlap(result: OverlapResult) -> str:
    return (
        f"blended request: {result.chunks} chunks x {result.chunk_tokens} tokens cold on disk, "
        "cacheblend\n"
        f"  KV load time {result.load_s * 1000:.1f} ms, waited {result.wait_s * 1000:.1f} ms -> "
        f"hidden behind compute: {result.hidden_share:.1%} (target >= 80%)\n"
        f"  median TTFT cold-disk {result.ttft_cold_disk_s * 1000:.1f} ms vs KV in memory "
        f"{result.ttft_in_memory_s * 1000:.1f} ms (ratio "
        f"{result.ttft_cold_disk_s / result.ttft_in_memory_s:.2f})"
    )
