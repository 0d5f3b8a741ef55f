"""ASGI middleware: requests and latencies per route template (bounded labels), and the
last line of defence that turns an unexpected exception into a JSON 500.
"""

from __future__ import annotations

import logging
import time

from app.api.errors import error_response

log = logging.getLogger(__name__)


class ErrorMiddleware:
    """An exception no handler took becomes a logged JSON 500 that keeps the connection open.

    Starlette's own outermost handler sends its 500 and then re-raises (so servers can log
    it); uvicorn answers a re-raise after the response started by closing the connection,
    and the client's next request on that keep-alive connection fails with ECONNRESET.
    Here the exception ends with the 500. If the response had already started (a stream),
    nothing valid can be sent any more: it is re-raised, and closing is right.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await error_response(500, "internal server error")(scope, receive, send)


class MetricsMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    @staticmethod
    def _record(scope, status: int, seconds: float) -> None:
        services = getattr(scope["app"].state, "services", None)
        if services is None:
            return
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        services.metrics.requests.labels(route, scope["method"], str(status)).inc()
        services.metrics.latency.labels(route).observe(seconds)
