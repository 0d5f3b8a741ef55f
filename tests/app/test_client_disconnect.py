"""A client gone before its request body arrived (#59 item 3) is a 499 on every route, logged
once at INFO naming the request, never an ERROR with a traceback nor a 500 in /metrics."""

from __future__ import annotations

import logging
import re
import socket
import time

import httpx
import pytest

BOUNDARY = "kvmosaicboundary"
PARTIAL = {
    "json": (
        "/documents",
        "application/json",
        b'{"text": "the start of a document that never ends',
    ),
    "multipart": (
        "/documents",
        f"multipart/form-data; boundary={BOUNDARY}",
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
            'filename="notes.txt"\r\nContent-Type: text/plain\r\n\r\nthe start of'
        ).encode(),
    ),
    "ask": ("/ask", "application/json", b'{"question": "When was the ferry'),
}


def send_part_and_leave(url: str, path: str, content_type: str, part: bytes) -> None:
    """Headers that promise more body than is sent, part of the body, then a closed socket."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(part) + 1000}\r\nX-Request-ID: gone-{path.strip('/')}\r\n"
        )
        sock.sendall(f"{head}\r\n".encode() + part)
        time.sleep(0.2)  # the route is reading the body when the client goes


def statuses(url: str, path: str) -> dict[str, float]:
    """{status: count} of `POST path` in /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = rf'kvmosaic_http_requests_total\{{[^}}]*route="{path}"[^}}]*\}} (\S+)'
    found: dict[str, float] = {}
    for line in text.splitlines():
        if re.match(pattern, line) and 'method="POST"' in line:
            status = re.search(r'status="(\d+)"', line)
            assert status is not None
            found[status.group(1)] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.parametrize("kind", list(PARTIAL))
def test_a_client_gone_mid_body_is_a_499_logged_once(live_url, caplog, kind):
    path, content_type, part = PARTIAL[kind]
    before = statuses(live_url, path).get("499", 0.0)
    with caplog.at_level(logging.INFO):
        send_part_and_leave(live_url, path, content_type, part)
        deadline = time.monotonic() + 10
        while statuses(live_url, path).get("499", 0.0) == before:
            assert time.monotonic() < deadline, statuses(live_url, path)
            time.sleep(0.1)
    assert "500" not in statuses(live_url, path)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    [line] = [r for r in caplog.records if "disconnected before" in r.getMessage()]
    assert line.levelno == logging.INFO and line.exc_info is None
    assert f"gone-{path.strip('/')}" in line.getMessage()
