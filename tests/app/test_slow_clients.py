"""Slow clients cannot lock everyone out (#59 item 1): thousands of connections trickling their
headers or body stay open only until their deadline, new clients are served meanwhile, and past
`max_connections` the oldest waiting connection makes room for a new one.

Loopback only, bounded in count and time: the server runs in a thread of this process on the
module's tiny-model services, behind `app.server.server_config` as `kvmosaic serve` runs it.
"""

from __future__ import annotations

import contextlib
import resource
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from app.main import create_app
from app.server import server_config
from tests.app.conftest import free_port

SLOW_HEADERS = 1900
SLOW_BODIES = 100
HEADER_TIMEOUT_S = 8.0
BODY_TIMEOUT_S = 8.0
# What a loaded two-core machine shared with other work may take to answer one small request.
ANSWER_WITHIN_S = 5.0


@contextlib.contextmanager
def serving(services, **limits: object) -> Iterator[tuple[str, uvicorn.Server]]:
    """The app on a free loopback port, in a thread, with these settings changed."""
    settings = services.settings.model_copy(
        update={"host": "127.0.0.1", "port": free_port(), **limits}
    )
    config = server_config(create_app(services=services), settings, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{settings.port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="module", autouse=True)
def enough_file_descriptors():
    """Both ends of every slow connection live in this process."""
    needed = 2 * (SLOW_HEADERS + SLOW_BODIES) + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the open-file hard limit {hard} is below {needed}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class SlowClients:
    """Connections that send part of a request, then a byte now and then (never the rest)."""

    def __init__(self, url: str) -> None:
        self.port = int(url.rsplit(":", 1)[1])
        self.sockets: list[socket.socket] = []
        self.closed: set[socket.socket] = set()

    def open(self, count: int, body: bool) -> None:
        start = (
            b"POST /documents HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 4000\r\n\r\n{"text": "'
            if body
            else b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        )
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", self.port))
            sock.sendall(start)
            sock.setblocking(False)
            self.sockets.append(sock)

    def trickle(self) -> None:
        """One more byte on every connection the server has not closed."""
        for sock in self.sockets:
            if sock not in self.closed:
                with contextlib.suppress(BlockingIOError):
                    try:
                        sock.send(b"x")
                    except OSError:
                        self.closed.add(sock)

    def note_closed(self, wait_s: float) -> None:
        """Mark the connections the server closed (end of stream or reset) within `wait_s`."""
        with selectors.DefaultSelector() as selector:
            for sock in self.sockets:
                if sock not in self.closed:
                    selector.register(sock, selectors.EVENT_READ)
            for key, _ in selector.select(timeout=wait_s):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    while sock.recv(4096):  # a 408, then the end of the stream
                        pass
                    self.closed.add(sock)
                except BlockingIOError:
                    pass
                except OSError:
                    self.closed.add(sock)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def timed(call) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = call()
    return response, time.perf_counter() - started


def test_new_clients_are_served_while_slow_clients_hold_connections(services):
    limits = dict(
        header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S, max_connections=3000
    )
    with serving(services, **limits) as (url, server):
        slow = SlowClients(url)
        httpx.post(f"{url}/ask", json={"question": "ferry?"}, timeout=60)  # warm-up
        ask_before = timed(
            lambda: httpx.post(f"{url}/ask", json={"question": "ferry?"}, timeout=60)
        )
        health_before = timed(lambda: httpx.get(f"{url}/healthz", timeout=30))
        try:
            opened = time.monotonic()
            slow.open(SLOW_HEADERS, body=False)
            slow.open(SLOW_BODIES, body=True)
            while len(server.server_state.connections) < SLOW_HEADERS + SLOW_BODIES:
                assert time.monotonic() - opened < HEADER_TIMEOUT_S, "the server did not accept"
                time.sleep(0.05)
            # new clients, each on a new connection, while every slow one is open
            health = [timed(lambda: httpx.get(f"{url}/healthz", timeout=30)) for _ in range(5)]
            ask = timed(lambda: httpx.post(f"{url}/ask", json={"question": "ferry?"}, timeout=60))
            assert len(slow.closed) == 0 and time.monotonic() - opened < HEADER_TIMEOUT_S
            for response, seconds in [*health, ask]:
                assert response.status_code == 200, response.text
                assert seconds < ANSWER_WITHIN_S, seconds
            print(
                f"\n{SLOW_HEADERS + SLOW_BODIES} slow connections open: healthz "
                f"{max(s for _, s in health) * 1000:.0f} ms at most, ask {ask[1] * 1000:.0f} ms "
                f"(none open: healthz {health_before[1] * 1000:.0f} ms, "
                f"ask {ask_before[1] * 1000:.0f} ms)"
            )
            # the server closes every slow connection at its deadline, trickle as they may
            deadline = opened + max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + 10
            while len(slow.closed) < len(slow.sockets) and time.monotonic() < deadline:
                slow.trickle()
                slow.note_closed(0.5)
            assert len(slow.closed) == len(slow.sockets)
            print(f"all closed {time.monotonic() - opened:.1f} s after the first was opened")
            assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200
        finally:
            slow.close()


def test_past_the_connection_bound_the_oldest_waiting_connection_makes_room(services):
    with serving(services, header_timeout_s=60.0, max_connections=100) as (url, server):
        slow = SlowClients(url)
        try:
            slow.open(150, body=False)
            slow.note_closed(2.0)
            for _ in range(5):
                assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200
            slow.note_closed(1.0)
            assert len(slow.closed) >= 50
            assert slow.sockets[0] in slow.closed and slow.sockets[-1] not in slow.closed
            assert len(server.server_state.connections) <= 100
        finally:
            slow.close()


def test_the_connection_bound_fits_the_open_file_limit(monkeypatch, caplog):
    from app import server

    limits = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr(server.resource, "getrlimit", lambda _: (limits["soft"], limits["hard"]))
    monkeypatch.setattr(server.resource, "setrlimit", lambda _, new: limits.update(soft=new[0]))
    assert server.fitting_connections(2048) == 2048  # the soft limit raised to fit
    assert limits["soft"] == 2048 + server.RESERVED_FDS
    limits.update(soft=1024, hard=1024)
    assert server.fitting_connections(2048) == 1024 - server.RESERVED_FDS
    assert "KVMOSAIC_MAX_CONNECTIONS=2048 does not fit" in caplog.text


class FakeConnection:
    """What `ConnectionGuard` asks of a connection."""

    def __init__(self, waiting: bool) -> None:
        self.waiting, self.dropped = waiting, None

    def waiting_on_client(self) -> bool:
        return self.waiting

    def drop(self, reason: str) -> None:
        self.dropped = reason


def test_the_guard_evicts_the_oldest_waiting_connection_or_refuses_when_all_are_busy():
    from app.connections import ConnectionGuard, ConnectionLimits

    guard = ConnectionGuard(ConnectionLimits(1.0, 1.0, max_connections=2))
    busy, slow, newer = FakeConnection(False), FakeConnection(True), FakeConnection(True)
    assert guard.admit(busy) and guard.admit(slow)
    assert guard.admit(newer)
    assert slow.dropped == "evicted" and busy.dropped is None
    guard.forget(slow)  # its connection_lost
    newer.waiting = False
    assert not guard.admit(FakeConnection(True))
    assert list(guard.open) == [busy, newer]


def test_a_request_whose_headers_never_end_gets_a_408(services):
    with serving(services, header_timeout_s=1.0) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 "), answer
