"""Map every refused request to a clear JSON error (`schemas.errors.ErrorBody`).

Malformed JSON → 400, schema violations → 422, engine `InvalidRequest` (unknown mode, prompt
too long, ...) → 422, missing resources → 404, full queue → 503 with Retry-After, a catalog
that cannot write (no space left, a read-only volume) → 507, naming the cause, a client gone
before its body arrived → 499 (one INFO line). Anything
else is a bug: `app.middleware.ErrorMiddleware` answers 500 with a generic message (the
traceback goes to the log, not the client) and keeps the connection usable.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.api.abandon import ClientGone, request_label
from app.catalog import CatalogUnwritable, LeaseLost
from app.ingest import IngestInProgress
from app.queue import QueueFull
from app.schemas.errors import ErrorBody
from engine.errors import InvalidRequest

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_busy",
    507: "insufficient_storage",
}


# What each refusal means, for the OpenAPI document (`documented`).
_DESCRIPTIONS = {
    400: "the body is not valid JSON",
    401: "missing or wrong bearer token",
    403: "not allowed (no token configured, or a cross-site write)",
    404: "no such resource",
    411: "a file upload without Content-Length",
    413: "the document is larger than the limit",
    415: "unsupported content type",
    422: "a field is invalid (the message says which)",
    503: "the work queue is full (or, for an upload, the same text is being ingested "
    "elsewhere); retry after `Retry-After` seconds",
    507: "the catalog cannot write (no space left, a read-only volume): nothing was changed; "
    "the message names the cause",
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, all with the one `ErrorBody` shape."""
    return {
        status: {"model": ErrorBody, "description": _DESCRIPTIONS[status]} for status in statuses
    }


def error_response(
    status: int,
    message: str,
    details: list[dict[str, object]] | None = None,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    body: dict[str, object] = {
        "type": _TYPES.get(status, "api_error"),
        "message": message,
        "param": param,
        "code": None,
    }
    if details is not None:
        body["details"] = details
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def error_body(exc: BaseException) -> dict[str, dict[str, str | None]]:
    """The error body for an exception raised inside a stream (after the 200 was sent)."""
    if isinstance(exc, InvalidRequest):
        return {
            "error": {
                "type": "invalid_request_error",
                "message": str(exc),
                "param": None,
                "code": None,
            }
        }
    log.error("error while streaming an answer", exc_info=exc)
    return {
        "error": {
            "type": "api_error",
            "message": "internal server error",
            "param": None,
            "code": None,
        }
    }


def install_error_handlers(app: FastAPI) -> None:
    _handle(app, RequestValidationError, _validation_error)
    _handle(app, StarletteHTTPException, _http_error)
    _handle(app, InvalidRequest, _invalid_request)
    _handle(app, QueueFull, _queue_full)
    _handle(app, LeaseLost, _lease_lost)
    _handle(app, CatalogUnwritable, _catalog_unwritable)
    _handle(app, IngestInProgress, _ingest_in_progress)
    _handle(app, ClientGone, _client_gone)
    _handle(app, ClientDisconnect, _client_disconnected)


E = TypeVar("E", bound=Exception)


def _handle(
    app: FastAPI, kind: type[E], handler: Callable[[Request, E], Awaitable[JSONResponse]]
) -> None:
    """Answer `kind` with `handler`, which Starlette hands only a `kind` (its own signature takes
    any exception, so `add_exception_handler` cannot check that the two match; this does)."""
    app.exception_handler(kind)(handler)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "the request body is not valid JSON")
    details = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors
    ]
    first = details[0] if details else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"] if p != "body")
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    return error_response(422, message, details, param=where or None)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's 400 for a body it could not read
        return await _client_disconnected(request, exc.__cause__)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
    return error_response(422, str(exc))


async def _lease_lost(request: Request, exc: LeaseLost) -> JSONResponse:
    """This replica stalled past its ingest lease and a peer (or a delete) took the document
    away: nothing was added; the same request again starts afresh."""
    return error_response(
        503,
        f"the ingest was interrupted and undone, send it again: {exc}",
        headers={"Retry-After": "1"},
    )


async def _catalog_unwritable(request: Request, exc: CatalogUnwritable) -> JSONResponse:
    """507 Insufficient Storage: the database refused the write and rolled it back, so the
    request changed nothing (`exc` says what it did not do); /readyz shows when the catalog
    writes again."""
    return error_response(507, f"{exc}; free space on the server's data volume, then send it again")


async def _ingest_in_progress(request: Request, exc: IngestInProgress) -> JSONResponse:
    return error_response(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)})


async def _client_gone(request: Request, exc: ClientGone) -> JSONResponse:
    """Nobody will read it: 499 ("client closed request", nginx's code) is for the request log and
    metrics."""
    return error_response(499, str(exc))


async def _client_disconnected(request: Request, exc: ClientDisconnect) -> JSONResponse:
    """The client went away while sending its body: nothing was done, nobody reads the answer.
    A 499 for the request log and metrics, one INFO line (it is the client's doing, and a slow
    client closed at its body deadline ends here too)."""
    log.info(
        "request %s: the client disconnected before its request body arrived; nothing was done",
        request_label(request),
    )
    return error_response(499, "the client disconnected before its request body arrived")


async def _queue_full(request: Request, exc: QueueFull) -> JSONResponse:
    request.app.state.services.metrics.rejected.inc()
    return error_response(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
