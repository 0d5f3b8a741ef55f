"""`kvmosaic bench store --capacity`: hit rate of a capped tier against its capacity.

A synthetic corpus of `entries` chunk entries (token counts drawn uniformly from
`min_tokens`..`max_tokens`, stored by the codec, `layers` layers each: hit rates depend on
sizes relative to the cap, not on absolute bytes) is ingested into a store whose only tier
(`disk` by default, or `redis`) is capped at a fraction of the corpus's KV bytes; then a
seeded Zipf(`zipf_s`) trace of `accesses` lookups runs against it, ranks shuffled so hotness
is unrelated to ingest order. A lookup that hits is served; a miss recomputes the chunk and
puts it back, making room by the store's eviction policy (demotion has nowhere to go: the
single tier drops its victim). Each (policy, capacity) cell starts from an empty tier.

Reported per cell: the trace's hit rate, and its share of the hit rate of the same trace on
an uncapped tier (measured too; every lookup hits there, since ingest stored everything):
the issue's target is >= 80% of the uncapped hits at 25% capacity. The best any policy could do
knowing the
ranks, keeping the hottest entries that fit, is printed as `oracle`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.store import EntryMeta, KVEntry, StoreConfig, create_store
from app.store.quant import get_codec


@dataclass(frozen=True)
class CapacityOptions:
    fractions: tuple[float, ...] = (0.1, 0.25, 0.5)
    policies: tuple[str, ...] = ("lru", "lfu", "value")
    tier: str = "disk"
    entries: int = 300
    accesses: int = 3000
    zipf_s: float = 1.2  # the workload bench's default popularity skew
    min_tokens: int = 64
    max_tokens: int = 256
    layers: int = 2
    codec: str = "int4"
    seed: int = 0
    redis_url: str = "redis://127.0.0.1:6379/0"


@dataclass
class CapacityCell:
    policy: str
    fraction: float
    capacity_bytes: int
    hits: int
    accesses: int
    oracle_hit_rate: float

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.accesses, 1)


@dataclass
class CapacityResult:
    corpus_bytes: int
    entries: int
    uncapped_hit_rate: float = 1.0
    cells: list[CapacityCell] = field(default_factory=list)


def corpus(options: CapacityOptions) -> tuple[list[str], list[int]]:
    """(keys, token counts) of the synthetic entries, seeded."""
    rng = random.Random(options.seed)
    keys = [f"{i:032x}" for i in range(options.entries)]
    return keys, [rng.randint(options.min_tokens, options.max_tokens) for _ in keys]


def zipf_trace(options: CapacityOptions) -> list[int]:
    """`accesses` entry indices, P(rank r) ∝ 1 / r^s, ranks assigned to entries at random."""
    rng = random.Random(options.seed + 1)
    order = list(range(options.entries))
    rng.shuffle(order)  # order[r]: the entry of rank r + 1
    weights = [1.0 / (r + 1) ** options.zipf_s for r in range(options.entries)]
    return [
        order[r] for r in rng.choices(range(options.entries), weights=weights, k=options.accesses)
    ]


def _entry(options: CapacityOptions, index: int, tokens: int) -> KVEntry:
    generator = torch.Generator().manual_seed(index)
    kv = torch.randn(
        options.layers, 2, 3, tokens, 64, generator=generator
    )  # [layers, 2, heads, tokens, dim]
    meta = EntryMeta("bench", "bench", f"{index:064x}", 0, options.codec, tuple(kv.shape))
    return KVEntry(meta, get_codec(options.codec).encode(kv))


def oracle_hit_rate(trace: list[int], sizes: list[int], capacity: int) -> float:
    """Hit rate of keeping, statically, the most accessed entries (by this trace) that fit."""
    counts = [0] * len(sizes)
    for index in trace:
        counts[index] += 1
    kept, used = 0, 0
    for index in sorted(range(len(sizes)), key=lambda i: counts[i] / sizes[i], reverse=True):
        if used + sizes[index] <= capacity:
            used += sizes[index]
            kept += counts[index]
    return kept / max(len(trace), 1)


def run_capacity(options: CapacityOptions, work_dir: Path, log=print) -> CapacityResult:
    get_codec(options.codec)
    keys, tokens = corpus(options)
    entries = [_entry(options, i, n) for i, n in enumerate(tokens)]
    sizes = [e.num_bytes for e in entries]
    trace = zipf_trace(options)
    result = CapacityResult(sum(sizes), len(entries))
    uncapped = _run_cell(
        options,
        work_dir / "uncapped",
        options.policies[0],
        result.corpus_bytes,
        keys,
        entries,
        trace,
    )
    result.uncapped_hit_rate = uncapped / max(len(trace), 1)
    for policy in options.policies:
        for fraction in options.fractions:
            capacity = int(fraction * result.corpus_bytes)
            hits = _run_cell(
                options, work_dir / f"{policy}-{fraction}", policy, capacity, keys, entries, trace
            )
            cell = CapacityCell(
                policy,
                fraction,
                capacity,
                hits,
                len(trace),
                oracle_hit_rate(trace, sizes, capacity),
            )
            result.cells.append(cell)
            log(
                f"  {policy:<6} {fraction:>5.0%}: hit rate {cell.hit_rate:.3f} (oracle "
                f"{cell.oracle_hit_rate:.3f})"
            )
    return result


def _run_cell(options, directory: Path, policy: str, capacity: int, keys, entries, trace) -> int:
    config = StoreConfig(
        tiers=(options.tier,),
        disk_dir=directory,
        disk_fsync=False,
        codec=options.codec,
        eviction=policy,
        redis_url=options.redis_url,
        redis_prefix=f"kvmosaic-capacity-{random.getrandbits(32):08x}:",
        **{f"{options.tier}_bytes": capacity},
    )
    store = create_store(config)
    try:
        for key, entry in zip(keys, entries):  # ingest: everything, the cap evicting as it goes
            store.put(key, entry)
        hits = 0
        for index in trace:
            if store.get(keys[index]) is not None:
                hits += 1
            else:  # a miss: the chunk is recomputed and stored again
                store.put(keys[index], entries[index])
        return hits
    finally:
        store.clear()
        store.close()


def format_capacity(result: CapacityResult, options: CapacityOptions) -> str:
    lines = [
        f"capacity: {result.entries} entries ({options.codec}, "
        f"{options.min_tokens}-{options.max_tokens} tokens, "
        f"{result.corpus_bytes / 1e6:.1f} MB), Zipf s={options.zipf_s} trace of {options.accesses} "
        "lookups, "
        f"tier {options.tier} capped; uncapped hit rate {result.uncapped_hit_rate:.3f}",
        f"{'policy':<7} {'capacity':>9} {'hit rate':>9} {'of uncapped':>12} {'oracle':>7}",
    ]
    for c in result.cells:
        lines.append(
            f"{c.policy:<7} {c.fraction:>8.0%} {c.hit_rate:>9.3f} "
            f"{c.hit_rate / max(result.uncapped_hit_rate, 1e-9):>11.1%} "
            f"{c.oracle_hit_rate:>7.3f}"
        )
    return "\n".join(lines)
