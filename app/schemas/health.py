"""`/healthz` and `/readyz`: liveness and readiness."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: str = Field(description="always 'ok' while the process answers")


class ReuseProfileOut(BaseModel):
    """The loaded model's reuse profile (engine/serving/profile.py)."""

    balanced_modes: list[str] = Field(
        description="modes whose blends `balanced` may run on this model (measured to hold)"
    )
    exact_first: bool = Field(
        description="no blend holds: balanced requests reuse exact variants and the exact "
        "prefix and compute the rest"
    )
    source: str = Field(description="the profile file in force, or 'none' (exact-first)")
    summary: str


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, bool] = Field(description="catalog, index, queue (room to submit), kv_reuse")
    index_rows: int
    index_cursor: int = Field(description="the catalog change sequence the local index has applied")
    tiers: dict[str, Literal["up", "degraded", "down"]] = Field(
        description=(
            "store tier: 'up', 'degraded' (serves reads, cannot write: writes go to the next tier) "
            "or 'down' "
            "(unreachable, skipped); both retried later"
        )
    )
    degraded: list[str] = Field(
        description=(
            "what is degraded now: store tiers that are degraded or down, and 'catalog' or "
            "'index' while the catalog or the local vector index file cannot write (they "
            "still serve reads; the catalog refuses writes with 507 meanwhile)"
        )
    )
    write_errors: dict[str, str] = Field(
        default_factory=dict,
        description="why each degraded tier, the catalog or the index cannot write",
    )
    queue: dict[str, int] = Field(description="running, waiting, capacity")
    reuse_profile: ReuseProfileOut | None = Field(
        default=None, description="what `balanced` may blend on the loaded model"
    )
