"""`/admin`: store and catalog statistics, eviction, cache clearing."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.schemas.common import ByteCount, RowId


class TierStats(BaseModel):
    model_config = ConfigDict(extra="allow")

    entries: int
    bytes: int
    capacity_bytes: int | None
    hits: int
    misses: int
    hit_rate: float | None
    available: bool = Field(description="reachable (false: down, skipped and retried later)")
    writable: bool = Field(
        description="its last write worked (false: degraded, writes go to the next tier)"
    )
    state: Literal["up", "degraded", "down"]
    write_error: str | None = Field(default=None, description="why it cannot write now")
    put_failures: int = Field(description="writes it refused since start (no space, I/O errors)")
    pinned: int = Field(description="entries requests hold now (not evicted)")
    evictions: int = Field(description="entries removed to make room (demoted or dropped)")
    demotions: int = Field(description="evicted entries written to the next tier")
    promotions: int = Field(description="entries copied up after a hit")
    corrupt: int = Field(
        description="entries found but refused (checksum, truncation, wrong model)"
    )


class AdminStats(BaseModel):
    tiers: dict[str, TierStats]
    documents: int
    chunks: int
    variants: dict[str, int] = Field(description="ready / missing")
    requests: dict[str, Any] = Field(description="answered, per mode, rejected, queue")
    mean_recompute_share: float | None
    index_rows: int
    model: str
    reuse_available: bool


class EvictRequest(BaseModel):
    """Say what to evict: a tier, a chunk, and/or bytes to free by a policy."""

    # "at least one of" (the validator below), for the OpenAPI document
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "anyOf": [
                {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                for name in ("tier", "chunk_id", "bytes")
            ]
        },
    )

    tier: str | None = None
    chunk_id: RowId | None = None
    policy: str | None = Field(default=None, description="lru, lfu or value (default: the store's)")
    bytes: ByteCount | None = Field(default=None, description="free at least this many bytes")

    @model_validator(mode="after")
    def _something(self) -> Self:
        if self.tier is None and self.chunk_id is None and self.bytes is None:
            raise ValueError("give at least one of tier, chunk_id, bytes")
        return self


class EvictResult(BaseModel):
    evicted_entries: int
    freed_bytes: int
