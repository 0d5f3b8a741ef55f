"""`StoreConfig`: every knob of the tiered KV store, one frozen dataclass built by the app.

Every default and description lives here, once: `app/settings.py` derives its `KVMOSAIC_STORE_*`
fields from these (`store_setting`), and `kvmosaic settings` prints the descriptions.
Evidence for the defaults: docs/benchmarks/codecs.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from app.store.codec_names import StoreCodec, VariantCodec
from app.store.codecs import CODECS, get_codec
from engine.config import described

GiB = 1 << 30
Tier = Literal["gpu", "cpu", "disk", "redis"]
KNOWN_TIERS: tuple[str, ...] = get_args(Tier)
Policy = Literal["lru", "lfu", "value"]
KNOWN_POLICIES: tuple[str, ...] = get_args(Policy)


@dataclass(frozen=True)
class StoreConfig:
    """Settings of the tiered store; each field's description is in its metadata
    (`field_doc(StoreConfig, name)`). Raises ValueError for unknown names and negative sizes."""

    tiers: tuple[Tier, ...] = described(
        ("gpu", "cpu", "disk"),
        "Tiers in lookup order, fastest first (`gpu`, `cpu`, `disk`, "
        "`redis`). A tier that cannot start (`gpu` without CUDA) is left out with a log line; an "
        "unreachable Redis is skipped and retried every `redis_retry_s`.",
    )
    gpu_bytes: int = described(1 * GiB, "Capacity of the `gpu` tier, in KV payload bytes.")
    cpu_bytes: int = described(4 * GiB, "Capacity of the `cpu` tier, in KV payload bytes.")
    disk_bytes: int = described(50 * GiB, "Capacity of the `disk` tier, in KV payload bytes.")
    redis_bytes: int = described(8 * GiB, "Capacity of the `redis` tier, in KV payload bytes.")
    disk_dir: Path = described(Path("data/kv"), "Directory of the disk tier's files.")
    disk_fsync: bool = described(
        True,
        "fsync each file and its directory before it becomes visible, "
        "so a power cut never leaves a torn entry (a crash never can: writes "
        "go to a temp file first).",
    )
    redis_url: str = described(
        "redis://127.0.0.1:6379/0",
        "Redis of the `redis` tier (shared by replicas; give it `maxmemory-policy noeviction`).",
    )
    redis_prefix: str = described(
        "kvmosaic:kv:",
        "Namespace of the tier's Redis keys (deployments sharing one Redis use different ones).",
    )
    redis_timeout_s: float = described(2.0, "Socket timeouts of the Redis tier.")
    redis_retry_s: float = described(
        30.0, "How long a Redis tier that failed is skipped before it is tried again."
    )
    codec: StoreCodec = described(
        "auto",
        "How chunk KV is stored in every tier (app/store/codecs/): `auto` = the model's own "
        "dtype where it is a 16-bit one (bfloat16, float16: exact), else `float16` (a float32 "
        "model: half the bytes, rounding below the model's own); `float16`, "
        "`bfloat16`, `float32`; quantized per channel and token (KIVI) `int8`, `int4`, `k4v3`; or "
        "after a Hadamard rotation `h4v3`, `h4v3c` (its bits split toward the check layers' "
        "values), `ch4v3` (keys centred per channel: the compressed codec recommended) and "
        "`ch4v3c`. Entries are decoded layer by layer on load; tiers keep and count the encoded "
        "bytes (docs/benchmarks/codecs.md).",
    )
    variant_codec: VariantCodec = described(
        "auto",
        "How context variants (a chunk's KV computed after other chunks) are stored; base "
        "variants use `codec`. `auto`: `codec` when it is a float one, else `float16`, because a "
        "lossy copy of an exact variant is not exact (the guard must then judge, and often re-run, "
        "the request). When it differs from `codec`, a chunk that a request computed exactly at "
        "the head of its prompt is also kept as a copy of its base in this codec, loaded before "
        "the base, so a recurring prompt starts exact.",
    )
    eviction: Policy = described(
        "lfu",
        "Eviction policy: `lru`, `lfu`, or `value` (expected savings × access frequency / "
        "size); `lfu` had the highest hit rate under a capped tier (docs/benchmarks/codecs.md).",
    )
    load_threads: int = described(2, "Background threads that read layers ahead of the compute.")
    prefetch_layers: int = described(
        2, "How many layers ahead of the one the runner asks for are read."
    )

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in KNOWN_TIERS]
        if unknown or not self.tiers or len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers must be distinct names among {KNOWN_TIERS}, got {self.tiers}")
        for tier in KNOWN_TIERS:
            if self.capacity(tier) < 0:
                raise ValueError(f"{tier}_bytes must be >= 0")
        if self.codec != "auto" and self.codec not in CODECS:
            raise ValueError(f"codec must be 'auto' or one of {tuple(CODECS)}")
        if self.variant_codec != "auto" and self.variant_codec not in CODECS:
            raise ValueError(f"variant_codec must be 'auto' or one of {tuple(CODECS)}")
        if self.eviction not in KNOWN_POLICIES:
            raise ValueError(f"eviction must be one of {KNOWN_POLICIES}")
        if self.load_threads < 1 or self.prefetch_layers < 1:
            raise ValueError("load_threads and prefetch_layers must be >= 1")

    def for_model(self, model_dtype: str) -> StoreConfig:
        """This config for a model computing in `model_dtype` ("float32", "bfloat16", ...):
        `codec` `auto` resolved to that dtype where it is a 16-bit float, else float16."""
        if self.codec != "auto":
            return self
        codec: StoreCodec = "bfloat16" if model_dtype == "bfloat16" else "float16"
        return dataclasses.replace(self, codec=codec)

    @property
    def context_variant_codec(self) -> str:
        """The codec context variants are stored in (`variant_codec` with `auto` resolved);
        needs `codec` resolved (`for_model`)."""
        if self.codec == "auto":
            raise ValueError("the store's codec is still 'auto': resolve it with for_model()")
        if self.variant_codec != "auto":
            return self.variant_codec
        return "float16" if get_codec(self.codec).lossy else self.codec

    def capacity(self, tier: str) -> int:
        return int(getattr(self, f"{tier}_bytes"))
