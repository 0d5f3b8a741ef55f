"""Fixtures for the service tests: the app on the tiny random-weight model, in-process and live.

One module-scoped `Services` per test module (tiny model, real MiniLM, SQLite catalog, cpu +
disk store in a temporary data dir) with a few small documents ingested. `client` drives it
in-process with FastAPI's httpx-based TestClient; `live_url` serves it with uvicorn on a
free loopback port for tests that need real HTTP (streaming, concurrency, openai, browser).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from retrieval import SourceDocument

ADMIN_TOKEN = "test-admin-token"
# The in-process client's address: loopback, like a browser on the serving machine, so the
# default write rule (no write token: loopback clients only) lets the tests add documents.
LOCAL_CLIENT = ("127.0.0.1", 50000)

DOCS = [
    SourceDocument(
        "test:lighthouse",
        "Hollin Point Lighthouse",
        "The Hollin Point Lighthouse was first lit on 3 November 1811. Its tower is 31 metres "
        "tall. The lamp burned whale oil, then paraffin from 1868, and was electrified in 1954.",
    ),
    SourceDocument(
        "test:mill",
        "Saltcote Tide Mill",
        "The Saltcote Tide Mill was built in 1734. A tide mill stores sea water in a pond at high "
        "tide and lets it out through the wheel when the tide falls. It was restored in 2006.",
    ),
    SourceDocument(
        "test:bees",
        "The waggle dance",
        "A honeybee tells her sisters where flowers are by dancing. The direction of the waggle "
        "run shows the direction of the food relative to the Sun; its length shows the distance.",
    ),
    SourceDocument(
        "test:ferry",
        "The Guillemot ferry",
        "The Guillemot ferry crosses to Skarra island in about forty minutes. It runs from April "
        "to October, twice a day, and carries up to 80 passengers but no cars.",
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_chat_answers(client, question: str, **extras) -> None:
    """`/v1/chat/completions` answers `question` with kvmosaic's `extras` (200 and a message)."""
    response = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": question}], **extras},
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def make_settings(data_dir, **overrides):
    from app.settings import Settings

    values = dict(
        data_dir=data_dir,
        store_tiers=("cpu", "disk"),
        store_cpu_bytes=64 << 20,
        store_disk_bytes=256 << 20,
        admin_token=ADMIN_TOKEN,
        workers=2,
        queue_size=6,
        chunk_tokens=48,
        chunk_overlap=8,
        default_max_tokens=8,
        max_tokens_limit=64,
        max_upload_bytes=4096,
        max_question_chars=300,
        epic_tokens=4,
        default_mode="cacheblend",  # the tests name the mode they expect
        fidelity="fast",  # ... and see it as it is (the guard: tests/app/test_guard_api.py)
        allowed_hosts=("testserver",),
    )  # the in-process client's Host, beside the loopback names
    values.update(overrides)
    return Settings(**values)


def start_services(tiny_loaded, embedder, data_dir, docs=DOCS, **overrides):
    from app.services import Services
    from engine.engine import Engine

    settings = make_settings(data_dir, **overrides)
    services = Services.start(
        settings, engine=Engine(settings.engine_config(), tiny_loaded), embedder=embedder
    )
    for doc in docs:
        services.ingestor.ingest(doc)
    return services


@pytest.fixture(scope="module")
def services(tiny_loaded, embedder, tmp_path_factory):
    services = start_services(tiny_loaded, embedder, tmp_path_factory.mktemp("data"))
    yield services
    services.close()


@pytest.fixture(scope="module")
def client(services):
    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app(services=services), client=LOCAL_CLIENT) as client:
        yield client


@pytest.fixture(scope="module")
def live_url(services):
    """The app served by uvicorn in a thread on a free loopback port."""
    import uvicorn

    from app.main import create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(services=services),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
