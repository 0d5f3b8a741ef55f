"""ASGI middleware: requests and latencies per route template (bounded labels), the last
line of defence that turns an unexpected exception into a JSON 500, `OPTIONS` and 405 with
the true `Allow` header, the security headers of every response, and a request id on each
request (`X-Request-ID`) for the log lines about it.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            log.exception(
                "unhandled error on %s %s (request %s)",
                scope.get("method"),
                scope.get("path"),
                request_id(scope),
            )
            if started:
                raise
            await error_response(500, "internal server error")(scope, receive, send)


# A client's own X-Request-ID is kept if it is a short token (it goes into log lines as is).
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class RequestIdMiddleware:
    """Every HTTP request gets an id, kept in `scope["state"]["request_id"]` (a route reads it
    as `request.state.request_id`) and sent back as `X-Request-ID`: the client's own header
    when it is a short token (`CLIENT_REQUEST_ID`; a proxy's id follows the request), else a
    new random one. Log lines about a request name it, so a client can quote it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        rid = sent if CLIENT_REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(scope: Scope) -> str:
    """The id `RequestIdMiddleware` gave the request ("-" outside it, as in unit tests)."""
    state: Mapping[str, object] = scope.get("state") or {}
    rid = state.get("request_id", "-")
    return rid if isinstance(rid, str) else "-"


class MetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    @staticmethod
    def _record(scope: Scope, status: int, seconds: float) -> None:
        services = getattr(scope["app"].state, "services", None)
        if services is None:
            return
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        services.metrics.requests.labels(route, scope["method"], str(status)).inc()
        services.metrics.latency.labels(route).observe(seconds)


class AllowedMethodsMiddleware:
    """`OPTIONS` answers 204 and a method no route takes answers 405, both with an `Allow`
    header listing the methods of every route at the path.

    Starlette's own 405 names the methods of the first route whose path matches, so
    `/documents` (a GET route and a POST route) advertised only one of them. Requests a route
    takes, and paths no route is at (404), pass through untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        routes = scope["app"].routes
        if _match(routes, scope) is not Match.PARTIAL:  # a route takes it, or none is at the path
            return await self.app(scope, receive, send)
        methods = methods_at(routes, scope)
        allow = {"Allow": ", ".join(sorted(methods | {"OPTIONS"}))}
        if scope["method"] == "OPTIONS":
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": [(b"allow", allow["Allow"].encode())],
                }
            )
            return await send({"type": "http.response.body", "body": b""})
        await error_response(
            405, f"{scope['method']} is not allowed here; allowed: {allow['Allow']}", headers=allow
        )(scope, receive, send)


PROBED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _match(routes: Sequence[BaseRoute], scope: Scope) -> Match:
    """FULL if a route takes the request, PARTIAL if one is at its path with other methods, else
    NONE."""
    best = Match.NONE
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return match
        if match is Match.PARTIAL:
            best = match
    return best


def methods_at(routes: Sequence[BaseRoute], scope: Scope) -> set[str]:
    """The methods some route takes at the request's path (Starlette's own matching, so
    routers included in routers count)."""
    return {m for m in PROBED_METHODS if _match(routes, {**scope, "method": m}) is Match.FULL}


# The web demo loads its script and styles from /static and talks to this server only; the
# admin token it keeps in sessionStorage is what an injected script or a framing page would
# be after. /docs and /redoc (Swagger UI, ReDoc from a CDN with inline scripts) get no CSP.
DEMO_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors "
    "'none'"
)
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)


class SecurityHeadersMiddleware:
    """Every response gets `nosniff`, `X-Frame-Options: DENY` and `Referrer-Policy`; the web
    demo's (`/`, `/static/...`) also its Content-Security-Policy (`DEMO_CSP`). A header the
    route set itself is kept."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        extra = SECURITY_HEADERS
        if path == "/" or path.startswith("/static/"):
            extra = (*extra, (b"content-security-policy", DEMO_CSP.encode()))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(name, value) for name, value in extra if name not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
