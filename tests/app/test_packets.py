"""Learned packets through the server: ingest stores each chunk's base between them, a request
that asks (`packets: true`) reads them, and the request is refused where packets cannot keep
its promise (tiny model, packets of random numbers: the path is tested, not their quality)."""

from __future__ import annotations

import pytest
import torch

from app.report import PACKET_PIECE
from engine.adapt.packets import Packets
from tests.app.conftest import ADMIN_TOKEN, LOCAL_CLIENT, assert_chat_answers, start_services

QUESTION = "When was the lighthouse first lit?"
HEAD, TAIL = 3, 2


@pytest.fixture(scope="module")
def packets_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("packets") / "packets.safetensors"
    generator = torch.Generator().manual_seed(5)
    head, tail = (
        torch.randn(HEAD, 64, generator=generator),
        torch.randn(TAIL, 64, generator=generator),
    )
    Packets(head, tail).save(path, {"model": "tiny"})
    return path


@pytest.fixture(scope="module")
def services(tiny_loaded, embedder, tmp_path_factory, packets_file):
    """The module's server, with packets (conftest's `client` drives it)."""
    services = start_services(
        tiny_loaded, embedder, tmp_path_factory.mktemp("packets-data"), packets=str(packets_file)
    )
    yield services
    services.close()


def ask(client, **fields):
    response = client.post("/ask", json={"question": QUESTION, "top_k": 2, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def bases_of(services, chunk_id):
    """Token counts of the chunk's stored base variants, smallest first."""
    variants = services.catalog.variants_of_chunk(chunk_id, services.engine.fingerprint)
    return sorted(v.num_tokens for v in variants if not v.context)


def test_modes_name_the_packets_and_the_modes_that_may_read_them(client, services):
    modes = client.get("/modes").json()
    assert modes["packets"] == services.engine.packets.digest()
    assert modes["packet_modes"] == ["naive", "epic", "cacheblend"]


def test_ingest_stores_each_chunk_plain_and_between_the_packets(client, services):
    body = ask(client, mode="naive")
    for chunk in body["chunks"]:
        assert bases_of(services, chunk["chunk_id"]) == [chunk["tokens"], chunk["tokens"] + 5]


def test_a_request_with_packets_reads_the_packeted_bases_ingest_stored(client):
    plain = ask(client, mode="naive", explain=True)
    packeted = ask(client, mode="naive", packets=True, explain=True)
    assert packeted["packets"] and not plain["packets"]
    assert [c["chunk_id"] for c in packeted["chunks"]] == [c["chunk_id"] for c in plain["chunks"]]
    for with_packets, without in zip(packeted["chunks"], plain["chunks"]):
        assert with_packets["tokens"] == without["tokens"] + HEAD + TAIL
        pieces = with_packets["token_texts"]
        assert pieces[:HEAD] == [PACKET_PIECE] * HEAD and pieces[-TAIL:] == [PACKET_PIECE] * TAIL
        assert pieces[HEAD:-TAIL] == without["token_texts"]
        assert with_packets["cached"] and with_packets["variant"] == "base"
        assert with_packets["recomputed"] == 0
    assert packeted["usage"]["context_tokens"] == plain["usage"]["context_tokens"] + 2 * 5


def test_metrics_count_the_answers_read_between_packets(client):
    def counted(text: str, name: str) -> float:
        line = next((x for x in text.splitlines() if x.startswith(name)), None)
        return 0.0 if line is None else float(line.rsplit(" ", 1)[1])

    name = 'kvmosaic_packet_answers_total{mode="naive"}'
    before = counted(client.get("/metrics").text, name)
    ask(client, mode="naive")
    assert counted(client.get("/metrics").text, name) == before
    ask(client, mode="naive", packets=True)
    assert counted(client.get("/metrics").text, name) == before + 1


def test_packeted_bases_computed_on_use_answer_as_the_stored_ones(client):
    stored = ask(client, mode="naive", packets=True)
    cleared = client.delete("/admin/cache", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert cleared.status_code == 200, cleared.text
    computed = ask(client, mode="naive", packets=True)
    assert [c["variant"] for c in computed["chunks"]] == ["base (computed now)"] * 2
    assert computed["answer"] == stored["answer"]
    again = ask(client, mode="naive", packets=True)
    assert all(c["cached"] for c in again["chunks"]) and again["answer"] == stored["answer"]


def test_chat_completions_take_packets_as_an_extra(client):
    assert_chat_answers(client, QUESTION, mode="cacheblend", fidelity="fast", packets=True)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"mode": "naive", "fidelity": "balanced"}, "fidelity 'fast' only"),
        ({"mode": "naive", "fidelity": "exact"}, "fidelity 'fast' only"),
        ({"mode": "cachecraft"}, "naive, epic, cacheblend"),
        ({"mode": "prefix"}, "base variants only"),
        ({"mode": "full"}, "base variants only"),
    ],
)
def test_packets_are_refused_where_they_cannot_keep_the_promise(client, fields, words):
    response = client.post("/ask", json={"question": QUESTION, "packets": True, **fields})
    assert response.status_code == 422, response.text
    assert words in response.text


def test_a_server_without_packets_refuses_a_request_for_them(tiny_loaded, embedder, tmp_path):
    from fastapi.testclient import TestClient

    from app.main import create_app

    services = start_services(tiny_loaded, embedder, tmp_path, docs=[])
    try:
        with TestClient(create_app(services=services), client=LOCAL_CLIENT) as client:
            assert client.get("/modes").json()["packets"] is None
            response = client.post(
                "/ask", json={"question": QUESTION, "mode": "naive", "packets": True}
            )
    finally:
        services.close()
    assert response.status_code == 422 and "no learned packets" in response.text


def test_deleting_a_document_removes_its_packeted_bases(client, services):
    body = ask(client, mode="naive", packets=True)
    chunk = body["chunks"][0]
    assert chunk["tokens"] in bases_of(services, chunk["chunk_id"])  # the packeted base
    deleted = client.delete(f"/documents/{chunk['document_id']}")
    assert deleted.status_code == 204, deleted.text
    assert bases_of(services, chunk["chunk_id"]) == []


def test_a_request_valid_by_the_schema_is_answered_with_or_without_packets(services):
    from tests.app.test_schemathesis import assert_valid_asks_are_answered

    assert_valid_asks_are_answered(services)


def test_the_schema_names_what_the_servers_defaults_do_not_give():
    from app.api.openapi import add_packet_rule
    from app.settings import Settings

    for default_mode, fidelity, required in [
        ("cacheblend", "fast", []),
        ("cachecraft", "fast", ["mode"]),
        ("naive", "balanced", ["fidelity"]),
    ]:
        schemas = {
            name: {"properties": {"packets": {"type": "boolean"}}}
            for name in ("AskRequest", "ChatRequest")
        }
        settings = Settings(default_mode=default_mode, fidelity=fidelity)
        add_packet_rule(schemas, settings, has_packets=True)
        (rule,) = schemas["AskRequest"]["allOf"]
        assert rule["if"]["properties"] == {"packets": {"const": True}}
        assert rule["then"]["required"] == required
        (rule,) = schemas["ChatRequest"]["allOf"]
        # a null field takes the server's default: allowed where that default serves packets
        fast = ["fast"] if "fidelity" in required else ["fast", None]
        assert rule["then"]["properties"]["fidelity"] == {"enum": fast}
        readers = rule["then"]["properties"]["mode"]["enum"]
        assert (None in readers) is ("mode" not in required)
        add_packet_rule(schemas, settings, has_packets=False)
        assert schemas["AskRequest"]["properties"]["packets"]["enum"] == [False]
