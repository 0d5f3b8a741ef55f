"""ASGI middleware counting requests and latencies per route template (bounded labels)."""

from __future__ import annotations

import time


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
