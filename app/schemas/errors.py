"""The one error body every endpoint returns (OpenAI-shaped, so its client reads it too)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    details: list[Any] | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
