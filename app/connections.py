"""Slow clients cannot hold the server: every connection has a deadline for sending its request's
headers and one for its body, and open connections are bounded below the file-descriptor limit.

uvicorn has neither deadline (its `timeout_keep_alive` only closes a connection idle between
requests; a byte every few seconds keeps a half-sent request open for ever) and its
`limit_concurrency` answers 503 to new requests once enough slow connections are open, which
locks out everyone. Here `GuardedProtocol` wraps uvicorn's own HTTP protocol, unchanged, and
watches what the connection is waiting for:

- the request's headers (from its first byte, or from the connection's opening): at most
  `header_timeout_s`, then `408` and close;
- the request's body (from the end of the headers): at most `body_timeout_s`, then close (the
  route sees its client gone: a 499). Time while the server itself stopped reading (uvicorn's
  flow control, a route not reading yet) does not count against the client;
- the app's answer: no deadline here (a long answer is the app's business).

A connection opened while `max_connections` are open closes, to make room, the oldest one
that is waiting on its client (a slow one, or one idle between requests); when every open
connection is busy in the app, the new one gets a `503` and is closed. Either way new clients
keep being served and the process never runs out of file descriptors. What does not live
here: the deadlines' values (`Settings`), uvicorn's set-up (`app/server.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar, cast

log = logging.getLogger(__name__)

# How often at most the counts of connections closed for being slow are logged (one line).
REPORT_EVERY_S = 60.0

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 0\r\n"
    b"connection: close\r\n\r\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    """The deadlines of a request's headers and body, and the most connections open at once."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


class ConnectionGuard:
    """The connections of one server, oldest first, and the counts of those it closed. Used on
    the event loop's thread only."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: dict[GuardedProtocol, None] = {}  # insertion order: oldest first
        self.closed: Counter[str] = Counter()  # why: headers_timeout, body_timeout, evicted, busy
        self._unreported: Counter[str] = Counter()
        self._reported_at = time.monotonic()

    def admit(self, connection: GuardedProtocol) -> bool:
        """Add `connection`; at the limit, close the oldest connection waiting on its client to
        make room. False (nothing added) when every open connection is busy in the app."""
        if len(self.open) >= self.limits.max_connections:
            oldest = next((c for c in self.open if c.waiting_on_client()), None)
            if oldest is None:
                return False
            oldest.drop("evicted")
        self.open[connection] = None
        return True

    def forget(self, connection: GuardedProtocol) -> None:
        self.open.pop(connection, None)

    def count(self, reason: str) -> None:
        """Count a connection closed for `reason`; log the counts at most every
        `REPORT_EVERY_S` (one line, not one per connection: under attack there are thousands)."""
        self.closed[reason] += 1
        self._unreported[reason] += 1
        now = time.monotonic()
        if now - self._reported_at >= REPORT_EVERY_S:
            counts = ", ".join(f"{n} {why}" for why, n in sorted(self._unreported.items()))
            log.warning("closed slow or surplus connections: %s", counts)
            self._unreported.clear()
            self._reported_at = now


class GuardedProtocol(asyncio.Protocol):
    """uvicorn's HTTP protocol (`inner`, built with uvicorn's own arguments) behind the request
    deadlines and the connection bound of `guard`. Subclassed per server by `guarded_protocol`,
    which sets the two class attributes."""

    guard: ClassVar[ConnectionGuard]
    base: ClassVar[type[asyncio.Protocol]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner: Any = self.base(*args, **kwargs)  # uvicorn's protocols are untyped
        self.transport: asyncio.Transport | None = None
        self.phase: str | None = None  # what the armed deadline is for: "headers" or "body"
        self.deadline: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol, forwarded to uvicorn's protocol --------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self.transport = cast(asyncio.Transport, transport)
        self.inner.connection_made(transport)
        if not self.guard.admit(self):
            self.guard.count("busy")
            self.transport.write(BUSY)
            self.transport.close()
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)
        self._watch()

    def eof_received(self) -> bool | None:
        result: bool | None = self.inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.forget(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- the deadlines ----------------------------------------------------------------------------
    def awaited(self) -> str | None:
        """What the connection waits for from its client: "headers" (no request under way, or
        its headers incomplete), "body" (the app may be reading it), None (the app's turn)."""
        cycle = getattr(self.inner, "cycle", None)
        if cycle is None or cycle.response_complete:
            return "headers"
        if cycle.more_body and not cycle.disconnected:
            return "body"
        return None

    def waiting_on_client(self) -> bool:
        return self.awaited() is not None

    def _watch(self) -> None:
        """Arm the deadline of what the connection now waits for; a deadline already running for
        the same thing keeps running (a byte now and then does not extend it)."""
        phase = self.awaited()
        if phase == self.phase:
            return
        self._disarm()
        if phase is None or self.transport is None or self.transport.is_closing():
            return
        limits = self.guard.limits
        seconds = limits.header_timeout_s if phase == "headers" else limits.body_timeout_s
        self.phase = phase
        self.deadline = asyncio.get_running_loop().call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.phase = None, None

    def _expired(self) -> None:
        phase = self.phase
        self.deadline = None
        if self.awaited() != phase:  # moved on without data (e.g. the app answered): re-watch
            self.phase = None
            return self._watch()
        flow = getattr(self.inner, "flow", None)
        if flow is not None and flow.read_paused:  # the server stopped reading, not the client
            self.deadline = asyncio.get_running_loop().call_later(
                self.guard.limits.body_timeout_s, self._expired
            )
            return
        self.drop(f"{phase}_timeout")

    def drop(self, reason: str) -> None:
        """Close the connection (a 408 first when no request is under way), counting why."""
        self._disarm()
        self.guard.forget(self)
        self.guard.count(reason)
        if self.transport is None or self.transport.is_closing():
            return
        cycle = getattr(self.inner, "cycle", None)
        if cycle is None or cycle.response_complete:
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def guarded_protocol(
    limits: ConnectionLimits, base: type[asyncio.Protocol] | None = None
) -> type[GuardedProtocol]:
    """A protocol class for `uvicorn.Config(http=...)`: uvicorn's own HTTP protocol (`base`,
    default uvicorn's choice: httptools, else h11) behind one new `ConnectionGuard`."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    guard = ConnectionGuard(limits)
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": guard, "base": base})
