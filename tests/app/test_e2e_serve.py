"""End to end: `kvmosaic ingest` then `kvmosaic serve` (the real SmolLM2) on a free loopback port.

Talks to it over HTTP like a user would: readiness, a plain and a streamed `/ask`, the
`openai` client, `kvmosaic ask --server`, and a clean shutdown on SIGTERM.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.app.conftest import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KVMOSAIC = [str(Path(sys.executable).parent / "kvmosaic")]  # the installed console script
CORPUS = REPO / "app" / "demo_corpus"
ARTICLES = ["02-hollin-point-lighthouse.md", "07-guillemot-ferry.md", "13-honeybee-dance.md"]
QUESTION = "When was the Hollin Point Lighthouse first lit?"


@pytest.fixture(scope="module")
def server(smol_checkpoint, test_data_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("e2e")
    (data / "models").symlink_to(
        test_data_dir / "models"
    )  # the converted model, shared by the tests
    env = {
        **os.environ,
        "KVMOSAIC_DATA_DIR": str(data),
        "KVMOSAIC_STORE_TIERS": "cpu,disk",
        "KVMOSAIC_DEFAULT_MAX_TOKENS": "8",
        "KVMOSAIC_ADMIN_TOKEN": "e2e",
        "HF_HUB_OFFLINE": "1",
        "KVMOSAIC_WORKERS": "1",
    }
    ingest = subprocess.run(
        [*KVMOSAIC, "ingest", "--quiet", *(str(CORPUS / a) for a in ARTICLES)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ingest.returncode == 0, ingest.stderr
    assert "ingested 3 new documents (3 chunks" in ingest.stdout
    port = free_port()
    process = subprocess.Popen(
        [*KVMOSAIC, "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines = _reader(process)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_for(lines, f"kvmosaic: ready, open {url}", timeout=300)
        yield url.rstrip("/"), process, lines
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _reader(process) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue, text: str, timeout: float) -> None:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"server never printed {text!r}; output:\n{''.join(seen)}")


def best_match(report: dict) -> str:
    """The document of the chunk the retriever ranked first (the list is in prompt order, which
    the cache-aware order may change)."""
    return min(report["chunks"], key=lambda c: c["rank"])["document"]


def test_ready_and_answers(server):
    url, _, _ = server
    assert httpx.get(f"{url}/readyz").json()["ready"] is True
    body = httpx.post(f"{url}/ask", json={"question": QUESTION, "top_k": 3}, timeout=300).json()
    assert body["answer"].strip() and best_match(body) == "Hollin Point Lighthouse"
    assert all(c["cached"] for c in body["chunks"]) and body["usage"]["completion_tokens"] <= 8

    with httpx.stream(
        "POST", f"{url}/ask", json={"question": QUESTION, "top_k": 3, "stream": True}, timeout=300
    ) as response:
        frames = [line for line in response.iter_lines() if line.startswith(("event:", "data:"))]
    events = [f[6:].strip() for f in frames if f.startswith("event:")]
    data = [json.loads(f[5:]) for f in frames if f.startswith("data:")]
    assert events[-1] == "report" and set(events[:-1]) == {"piece"}
    assert "".join(d["text"] for d in data[:-1]) == data[-1]["answer"] == body["answer"]


def test_openai_client_and_cli_against_the_server(server):
    url, _, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    stream = client.chat.completions.create(
        model="kvmosaic",
        stream=True,
        max_tokens=8,
        messages=[{"role": "user", "content": "How long is the ferry crossing?"}],
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()
    cli = subprocess.run(
        [*KVMOSAIC, "ask", "--server", url, "--json", "What do bees dance for?"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    report = json.loads(cli.stdout[cli.stdout.index("{") :])
    assert best_match(report) == "The honeybee waggle dance"


def test_sigterm_shuts_down_cleanly(server):
    _, process, lines = server
    process.send_signal(signal.SIGTERM)
    _wait_for(lines, "Application shutdown complete", timeout=60)  # the lifespan closed the store
    # uvicorn re-raises the signal it handled once it has shut down gracefully
    assert process.wait(timeout=30) in (0, -signal.SIGTERM)
