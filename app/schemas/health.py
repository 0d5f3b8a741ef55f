"""`/healthz` and `/readyz`: liveness and readiness."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: str = Field(description="always 'ok' while the process answers")


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, bool] = Field(description="catalog, index, queue (room to submit), kv_reuse")
    index_rows: int
    index_cursor: int = Field(description="the catalog change sequence the local index has applied")
    tiers: dict[str, str] = Field(description="store tier: 'up', or 'down' (skipped, retried later)")
    degraded: list[str] = Field(description="the store tiers that are down now")
    queue: dict[str, int] = Field(description="running, waiting, capacity")
