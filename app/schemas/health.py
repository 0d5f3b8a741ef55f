"""`/healthz` and `/readyz`: liveness and readiness."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: str = Field(description="always 'ok' while the process answers")


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, bool] = Field(description="catalog, index, queue (room to submit), kv_reuse")
    index_rows: int
    queue: dict[str, int] = Field(description="running, waiting, capacity")
