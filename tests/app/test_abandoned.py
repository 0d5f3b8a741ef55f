"""A non-streamed answer whose client disconnected stops computing (app/api/abandon.py).

The app is driven over raw ASGI so that the test decides when the client disconnects, and
the work is measured by the engine's meters (prefill layer-rows, decode tokens), never by a
clock. One worker: a request queued behind a held job is dropped before its prefill; one
whose decode is held at its first step is cancelled at its next piece. Each is counted in
/metrics and logged with its stage and request id.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

import engine.serving.scheduler
from app.main import create_app
from tests.app.conftest import LOCAL_CLIENT, start_services

MAX_TOKENS = 64
ASK = {
    "question": "When was the lighthouse first lit?",
    "mode": "full",
    "max_tokens": MAX_TOKENS,
    "seed": 1,
}
BOUND_S = 120  # a bound against hanging when the fix is missing, never a measurement


@pytest.fixture(scope="module")
def served(tiny_loaded, embedder, tmp_path_factory):
    services = start_services(
        tiny_loaded,
        embedder,
        tmp_path_factory.mktemp("abandon"),
        workers=1,
        max_tokens_limit=MAX_TOKENS,
    )
    app = create_app(services=services)
    with TestClient(app, client=LOCAL_CLIENT):  # the lifespan, once
        yield app, services
    services.close()


async def post_then_leave(
    app, path: str, body: dict, leave: threading.Event, request_id: str = "-"
) -> int:
    """POST `body` (as `X-Request-ID: request_id`); the client disconnects once `leave` is
    set. Returns the status the app sent."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            (b"x-request-id", request_id.encode()),
        ],
        "client": LOCAL_CLIENT,
        "server": ("testserver", 80),
    }
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.to_thread(leave.wait)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), BOUND_S)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def abandoned(services, stage: str) -> float:
    value = services.metrics.registry.get_sample_value(
        "kvmosaic_abandoned_requests_total", {"stage": stage}
    )
    return value or 0.0


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def logged(caplog, request_id: str, stage: str) -> list[str]:
    """The log lines that say request `request_id` was abandoned at `stage`."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING"
        and request_id in r.getMessage()
        and f"stage={stage}" in r.getMessage()
    ]


def wait_counted(services, stage: str, count: float) -> None:
    """Until the abandoned job has stopped: counted (after its end, on the worker's thread),
    and the queue empty."""
    wait_for(lambda: abandoned(services, stage) >= count, f"nothing counted as abandoned {stage}")
    wait_for(lambda: not services.queue.pending, "the queue never emptied")


def work(services) -> tuple[int, int]:
    """(prefill layer-rows, decode tokens) the engine has computed so far."""
    engine = services.engine
    return engine.runner.meter.snapshot().layer_rows, engine.scheduler.num_tokens


@pytest.mark.parametrize("path", ["/ask", "/v1/chat/completions"])
def test_a_queued_request_whose_client_left_is_dropped_before_its_prefill(served, path, caplog):
    app, services = served
    body = (
        ASK
        if path == "/ask"
        else {
            "messages": [{"role": "user", "content": ASK["question"]}],
            "max_tokens": MAX_TOKENS,
            "mode": "full",
        }
    )
    gate = threading.Event()
    holder = services.queue.submit(gate.wait)  # the only worker is busy: the request waits
    before, dropped = work(services), abandoned(services, "queued")
    left = threading.Event()
    left.set()  # the client gives up at once
    rid = f"queued-{path.strip('/').replace('/', '-')}"
    try:
        assert asyncio.run(post_then_leave(app, path, body, left, rid)) == 499
    finally:
        gate.set()
    holder.result()
    wait_counted(services, "queued", dropped + 1)
    assert work(services) == before  # no prefill, no decode
    assert abandoned(services, "queued") == dropped + 1
    assert services.queue.num_dropped >= 1
    (line,) = logged(caplog, rid, "queued")
    assert f"POST {path}" in line


def test_a_decoding_request_whose_client_left_stops_at_its_next_token(served, monkeypatch, caplog):
    app, services = served
    with TestClient(app, client=LOCAL_CLIENT) as client:  # what the full answer costs
        full = client.post("/ask", json=ASK).json()
    assert full["usage"]["completion_tokens"] > 8, "the tiny model stopped early: no test"

    stepping, release = threading.Event(), threading.Event()
    decode_batch = engine.serving.scheduler.decode_batch

    def held_step(*args, **kwargs):  # the first decode step waits until the client has left
        stepping.set()
        release.wait(BOUND_S)
        return decode_batch(*args, **kwargs)

    monkeypatch.setattr(engine.serving.scheduler, "decode_batch", held_step)
    before, cancelled = work(services), abandoned(services, "decoding")
    try:
        assert asyncio.run(post_then_leave(app, "/ask", ASK, stepping, "decoding-ask")) == 499
    finally:
        release.set()
    wait_counted(services, "decoding", cancelled + 1)
    decoded = work(services)[1] - before[1]
    # stopped within a step or two, not at the end
    assert decoded < 4 < full["usage"]["completion_tokens"]
    assert abandoned(services, "decoding") == cancelled + 1
    assert len(logged(caplog, "decoding-ask", "decoding")) == 1
    metrics = TestClient(app, client=LOCAL_CLIENT).get("/metrics").text
    assert 'kvmosaic_abandoned_requests_total{stage="decoding"}' in metrics
