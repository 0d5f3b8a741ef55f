"""The order stage in the request path (tiny model, the server's own services): a set of chunks
asked again in another retrieval order is served exactly under `cache-aware`, the report
says the order and which chunks were exact, and modes that load no context variants keep
the retrieval order."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.variants.order import ChunkOrder
from engine.errors import InvalidRequest
from tests.app.conftest import LOCAL_CLIENT, start_services

ALL = 20  # more than the chunks ingested: every request retrieves all of them, ranked by question
FIRST, SECOND = "When was the lighthouse first lit?", "How long does the ferry take to Skarra?"
THIRD = "When was the tide mill built?"


@pytest.fixture(scope="module")
def cache_aware(tiny_loaded, embedder, tmp_path_factory):
    services = start_services(
        tiny_loaded,
        embedder,
        tmp_path_factory.mktemp("ordered"),
        chunk_order="cache-aware",
        default_mode="prefix",
        default_top_k=ALL,
        index_poll_s=0.0,
    )
    yield services
    services.close()


def ask(services, question: str, mode: str = "prefix", order: str | None = None):
    return services.rag.ask(services.rag.query(question, mode=mode, order=order))


def test_the_same_chunks_in_another_retrieval_order_are_served_exactly(cache_aware):
    first = ask(cache_aware, FIRST)
    assert (
        first.order.ordering.rule is ChunkOrder.CACHE_AWARE and not first.order.reordered
    )  # nothing cached yet
    second = ask(cache_aware, SECOND)
    retrieval = [r.chunk_id for r in sorted(second.retrieved, key=lambda r: -r.score)]
    assert retrieval != [r.chunk_id for r in first.retrieved]  # the retriever ranks them otherwise
    assert [r.chunk_id for r in second.retrieved] == [
        r.chunk_id for r in first.retrieved
    ]  # the cached order
    assert second.order.reordered and second.order.ordering.exact == len(second.retrieved)
    assert all(second.served.exact_chunks) and second.served.computed == second.served.blended == 0
    again = ask(
        cache_aware, SECOND, order="retrieval"
    )  # the retriever's order: only its leading chunk is exact
    assert not again.order.reordered and again.served.exact < second.served.exact


def test_modes_that_load_no_context_variants_keep_the_retrieval_order(cache_aware):
    ask(cache_aware, FIRST)
    for mode in ("full", "cacheblend", "naive"):
        answer = ask(cache_aware, SECOND, mode=mode)
        assert not answer.order.reordered and answer.order.ordering.rule is ChunkOrder.RETRIEVAL
    assert (
        ask(cache_aware, SECOND, mode="full").served.computed
        == ask(cache_aware, SECOND, mode="full").served.total
    )


def test_an_unknown_order_is_refused(cache_aware):
    with pytest.raises(InvalidRequest, match="chunk order"):
        cache_aware.rag.query(FIRST, order="shuffled")


def test_the_report_shows_the_order_and_the_exact_chunks(cache_aware):
    ask(cache_aware, FIRST)
    with TestClient(create_app(services=cache_aware), client=LOCAL_CLIENT) as client:
        report = client.post("/ask", json={"question": THIRD, "mode": "prefix"}).json()
    order = report["order"]
    assert order["rule"] == "cache-aware" and order["planned_exact"] == len(report["chunks"])
    assert (
        order["exact_tokens"] == sum(c["tokens"] for c in report["chunks"])
        and order["computed_tokens"] == 0
    )
    assert all(c["exact"] for c in report["chunks"])
    assert sorted(c["rank"] for c in report["chunks"]) == list(range(len(report["chunks"])))
    assert [c["rank"] for c in report["chunks"]] != list(range(len(report["chunks"])))
