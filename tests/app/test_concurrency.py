"""Concurrent `/ask` requests are all served correctly; a full queue answers 503 + Retry-After at
once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.queue import QueueFull, WorkQueue

QUESTIONS = [
    "When was the lighthouse first lit?",
    "When was the tide mill built?",
    "How do bees show where flowers are?",
    "How long is the ferry crossing?",
]


def ask(url: str, question: str, stream: bool = False) -> dict:
    body = {"question": question, "top_k": 3, "max_tokens": 6}
    if not stream:
        return httpx.post(f"{url}/ask", json=body, timeout=120).json()
    with httpx.stream("POST", f"{url}/ask", json={**body, "stream": True}, timeout=120) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    import json

    return json.loads(lines[-1][5:])


def test_concurrent_asks_match_serial_answers(live_url, services):
    serial = {q: ask(live_url, q) for q in QUESTIONS}
    jobs = [(q, i % 2 == 1) for q in QUESTIONS for i in range(2)]  # 8 requests, half streamed
    assert len(jobs) <= services.queue.capacity
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: (job[0], ask(live_url, *job)), jobs))
    for question, report in results:
        assert report["answer"] == serial[question]["answer"]
        assert [c["chunk_id"] for c in report["chunks"]] == [
            c["chunk_id"] for c in serial[question]["chunks"]
        ]
        assert [c["recomputed"] for c in report["chunks"]] == [
            c["recomputed"] for c in serial[question]["chunks"]
        ]


def test_a_full_queue_answers_503_with_retry_after(live_url, services):
    release = threading.Event()
    blockers = [services.queue.submit(release.wait, 30) for _ in range(services.queue.capacity)]
    try:
        started = time.perf_counter()
        for path, body in (
            ("/ask", {"question": "Anyone there?"}),
            ("/ask", {"question": "Anyone there?", "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/documents", {"text": "queued text"}),
        ):
            response = httpx.post(f"{live_url}{path}", json=body, timeout=10)
            assert response.status_code == 503, path
            assert response.headers["retry-after"] == str(services.settings.retry_after_s)
            assert "busy" in response.json()["error"]["message"]
        assert time.perf_counter() - started < 5  # refused at once, never queued
        assert httpx.get(f"{live_url}/readyz").status_code == 503
        assert httpx.get(f"{live_url}/healthz").status_code == 200
    finally:
        release.set()
        for blocker in blockers:
            blocker.result(timeout=30)
    assert (
        httpx.post(
            f"{live_url}/ask", json={"question": "Anyone there?", "max_tokens": 2}, timeout=60
        ).status_code
        == 200
    )
    assert "kvmosaic_rejected_requests_total 4.0" in httpx.get(f"{live_url}/metrics").text


def test_a_client_that_leaves_mid_stream_frees_its_worker(live_url, services):
    body = {"question": "Tell me about the mill.", "max_tokens": 64, "stream": True}
    with httpx.stream("POST", f"{live_url}/ask", json=body, timeout=60) as response:
        next(response.iter_lines())  # the first piece arrives, then we hang up
    deadline = time.monotonic() + 20
    while services.queue.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert services.queue.pending == 0


def test_work_queue_bounds_and_counts():
    queue = WorkQueue(workers=1, queue_size=1, retry_after_s=7)
    gate = threading.Event()
    running = queue.submit(gate.wait, 10)
    waiting = queue.submit(lambda: "done")
    with pytest.raises(QueueFull) as refused:
        queue.submit(lambda: "never")
    assert refused.value.retry_after_s == 7 and queue.num_rejected == 1
    gate.set()
    assert running.result(5) and waiting.result(5) == "done"
    assert queue.pending == 0 and queue.num_completed == 2 and queue.can_submit()
    queue.shutdown()


def test_wait_idle_returns_when_the_last_job_finishes():
    queue = WorkQueue(workers=1, queue_size=1)
    assert queue.wait_idle(0)  # nothing submitted: idle at once
    gate = threading.Event()
    running = queue.submit(gate.wait, 10)
    assert not queue.wait_idle(0.05)  # a job runs: not idle within the timeout
    woken = ThreadPoolExecutor(1).submit(queue.wait_idle, 10)
    gate.set()
    assert woken.result(5) and running.result(5)
    queue.shutdown()


def test_workers_compute_nothing_while_the_engine_computes_for_them(
    services, tiny_loaded, embedder, tmp_path
):
    """With batching (one prefill slot) the engine computes on its scheduler's thread, so the
    workers run torch single-threaded; without batching they compute with the engine's count,
    whatever a helper thread set last (engine/serving/threads.py)."""
    import torch

    from tests.app.conftest import start_services

    assert services.engine.computes_on_scheduler
    assert services.queue.submit(torch.get_num_threads).result(timeout=30) == 1
    alone = start_services(tiny_loaded, embedder, tmp_path, docs=(), batching=False, num_threads=2)
    try:
        assert not alone.engine.computes_on_scheduler
        assert alone.queue.submit(torch.get_num_threads).result(timeout=30) == 2
    finally:
        alone.close()
