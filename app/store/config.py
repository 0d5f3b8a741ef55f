"""`StoreConfig`: every knob of the tiered KV store, one frozen dataclass built by the app."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.store.quant import CODECS, get_codec

GiB = 1 << 30
KNOWN_TIERS = ("gpu", "cpu", "disk", "redis")
KNOWN_POLICIES = ("lru", "lfu", "value")


@dataclass(frozen=True)
class StoreConfig:
    """Settings of the tiered store (env names the app maps them from in brackets).

    tiers: lookup order, fastest first [KVMOSAIC_STORE_TIERS, comma-separated]. A tier that
      cannot start (`gpu` without CUDA, unreachable Redis) is skipped with a log line.
    gpu_bytes / cpu_bytes / disk_bytes / redis_bytes: byte capacity of each tier, counted
      as KV payload bytes [KVMOSAIC_STORE_<TIER>_BYTES].
    disk_dir: directory of the disk tier's files [KVMOSAIC_STORE_DISK_DIR]; default
      `data/kv` (the app passes `<data_dir>/kv`).
    disk_fsync: fsync each file and its directory before it becomes visible, so a power
      cut never leaves a torn entry (a crash never can: writes go to a temp file first).
    redis_url: the shared Redis [KVMOSAIC_REDIS_URL]; redis_prefix: namespace of its keys
      (several deployments can share one Redis); redis_timeout_s: socket timeouts;
      redis_retry_s: how long a Redis tier that failed is skipped before it is tried again.
    codec: how KV is stored in every tier (`app/store/quant.py`): `float16` (the default;
      half of float32), `bfloat16`, `float32`, or quantized `int8` (0.53x float16's bytes),
      `int4` (0.28x) and `k4v3` (0.24x: 4-bit keys, 3-bit values), keys per channel and
      values per token (KIVI), or after a Hadamard rotation (`app/store/rotated.py`) `h4v3`
      (0.25x), `h4v3c` (its bits split toward the check layers' values), `ch4v3` (0.244x:
      keys centred per channel first; the compressed codec recommended) and `ch4v3c`.
      Entries are decoded to the engine's dtype layer by layer when loaded; tiers keep and
      count the encoded bytes [KVMOSAIC_STORE_CODEC].
    variant_codec: how context variants (a chunk's KV computed after other chunks: harvests
      and Cache-Craft's builds) are stored; base variants use `codec`. `auto` (the default):
      `codec` when it is a float codec, else `float16`, because a lossy copy of an exact
      variant is no longer exact (the guard must then judge and often re-run the request) and
      variants are the few hot entries, where bases are the whole corpus; any codec name
      forces that codec [KVMOSAIC_STORE_VARIANT_CODEC]. When it differs from `codec`, a
      chunk that a request computed exactly at the head of its prompt is also kept as a copy
      of its base in this codec, loaded before the base (so a recurring prompt starts exact).
    eviction: `lru`, `lfu` or `value` (expected savings x access frequency / size)
      [KVMOSAIC_STORE_EVICTION].
    load_threads: background threads that read layers ahead of the compute.
    prefetch_layers: how many layers ahead of the one the runner asks for are read.
    """

    tiers: tuple[str, ...] = ("gpu", "cpu", "disk")
    gpu_bytes: int = 1 * GiB
    cpu_bytes: int = 4 * GiB
    disk_bytes: int = 50 * GiB
    redis_bytes: int = 8 * GiB
    disk_dir: Path = Path("data/kv")
    disk_fsync: bool = True
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "kvmosaic:kv:"
    redis_timeout_s: float = 2.0
    redis_retry_s: float = 30.0
    codec: str = "float16"
    variant_codec: str = "auto"
    # lfu by measurement: `kvmosaic bench store --capacity` (300 entries, Zipf 1.0, 3000 lookups)
    # hit rate at 10 / 25 / 50% capacity: lfu 0.590 / 0.727 / 0.849, lru 0.499 / 0.689 / 0.833,
    # value 0.537 / 0.643 / 0.726
    eviction: str = "lfu"
    load_threads: int = 2
    prefetch_layers: int = 2

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in KNOWN_TIERS]
        if unknown or not self.tiers or len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers must be distinct names among {KNOWN_TIERS}, got {self.tiers}")
        for tier in KNOWN_TIERS:
            if self.capacity(tier) < 0:
                raise ValueError(f"{tier}_bytes must be >= 0")
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {tuple(CODECS)}")
        if self.variant_codec != "auto" and self.variant_codec not in CODECS:
            raise ValueError(f"variant_codec must be 'auto' or one of {tuple(CODECS)}")
        if self.eviction not in KNOWN_POLICIES:
            raise ValueError(f"eviction must be one of {KNOWN_POLICIES}")
        if self.load_threads < 1 or self.prefetch_layers < 1:
            raise ValueError("load_threads and prefetch_layers must be >= 1")

    @property
    def context_variant_codec(self) -> str:
        """The codec context variants are stored in (`variant_codec` with `auto` resolved)."""
        if self.variant_codec != "auto":
            return self.variant_codec
        return "float16" if get_codec(self.codec).lossy else self.codec

    def capacity(self, tier: str) -> int:
        return int(getattr(self, f"{tier}_bytes"))
