"""A catalog that cannot write logs its cause once per change of state (#59 item 6), not one
traceback per request: the requests it serves meanwhile (their variant accesses and new
variants are statistics and optimisations) answer and log nothing more."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.app.conftest import DOCS, LOCAL_CLIENT, start_services

QUESTIONS = ["When was the lighthouse first lit?", "When was the tide mill built?"]


@contextlib.contextmanager
def catalog_read_only(catalog) -> Iterator[None]:
    """Every connection of `catalog` refuses writes as a read-only volume does
    (SQLITE_READONLY); reads work."""
    from sqlalchemy import event

    def read_only(dbapi_connection, _record) -> None:
        dbapi_connection.execute("PRAGMA query_only = ON")

    engine = catalog.engine
    event.listen(engine, "connect", read_only)
    engine.dispose()
    try:
        yield
    finally:
        event.remove(engine, "connect", read_only)
        engine.dispose()


@pytest.fixture
def services(tiny_loaded, embedder, tmp_path):
    services = start_services(tiny_loaded, embedder, tmp_path, docs=DOCS[:2])
    yield services
    services.close()


def test_requests_on_a_read_only_catalog_log_no_tracebacks(services, caplog):
    with TestClient(create_app(services=services), client=LOCAL_CLIENT) as client:
        for question in QUESTIONS:  # leave variants and accesses to record
            client.post("/ask", json={"question": question, "mode": "cachecraft"})
        services.chunk_cache.drain()
        caplog.clear()
        with catalog_read_only(services.catalog), caplog.at_level(logging.INFO):
            for question in QUESTIONS * 3:
                answer = client.post("/ask", json={"question": question, "mode": "cachecraft"})
                assert answer.status_code == 200, answer.text
            services.chunk_cache.drain()
            assert services.catalog.write_error is not None  # it did find out
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert not tracebacks, [(r.name, r.getMessage()) for r in tracebacks]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot write" in errors[0], errors
