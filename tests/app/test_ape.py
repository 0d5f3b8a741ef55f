"""APE's reading through the server: a request that asks (`ape: true`) is read by the engine's
knobs, is counted, and is refused where APE cannot keep its promise (tiny model: the path is
tested, not the answers' quality; the numerics are tests/engine/test_ape.py's)."""

from __future__ import annotations

import dataclasses

import pytest

from app.rag import with_ape
from engine.errors import InvalidRequest
from tests.app.conftest import assert_chat_answers

QUESTION = "When was the lighthouse first lit?"


def ask(client, status=200, **fields):
    response = client.post("/ask", json={"question": QUESTION, "top_k": 3, **fields})
    assert response.status_code == status, response.text
    return response.json()


def test_modes_name_apes_knobs(client, services):
    body = client.get("/modes").json()
    assert body["ape"] == {
        "temperature": services.settings.ape_temperature,
        "scale": services.settings.ape_scale,
    }


def test_a_request_that_asks_is_read_by_ape_and_counted(client):
    def counted(text: str, name: str) -> float:
        line = next((x for x in text.splitlines() if x.startswith(name)), None)
        return 0.0 if line is None else float(line.rsplit(" ", 1)[1])

    name = 'kvmosaic_ape_answers_total{mode="cacheblend"}'
    before = counted(client.get("/metrics").text, name)
    plain = ask(client, mode="cacheblend", fidelity="fast")
    assert plain["ape"] is False
    assert counted(client.get("/metrics").text, name) == before
    read = ask(client, mode="cacheblend", fidelity="fast", ape=True)
    assert read["ape"] is True and read["mode"] == "cacheblend"
    assert [c["chunk_id"] for c in read["chunks"]] == [c["chunk_id"] for c in plain["chunks"]]
    assert counted(client.get("/metrics").text, name) == before + 1


def test_the_engine_reads_the_settings_knobs(services):
    query = services.rag.query(QUESTION, mode="naive", fidelity="fast", ape=True)
    assert query.ape
    answer = services.rag.ask(query)
    reading = answer.result.cache.reading
    assert reading is not None
    assert (reading.knobs.temperature, reading.knobs.scale) == (
        services.settings.ape_temperature,
        services.settings.ape_scale,
    )
    assert (reading.start, reading.end) == (
        answer.result.layout.prefix_len,
        answer.result.layout.question_span[0],
    )


def test_chat_completions_take_ape_as_an_extra(client):
    assert_chat_answers(client, QUESTION, mode="naive", fidelity="fast", ape=True)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"mode": "naive", "fidelity": "balanced"}, "fidelity 'fast' only"),
        ({"mode": "naive", "fidelity": "exact"}, "fidelity 'fast' only"),
        ({"mode": "cachecraft", "fidelity": "fast"}, "naive, epic, cacheblend"),
        ({"mode": "prefix", "fidelity": "fast"}, "base variants only"),
        ({"mode": "full", "fidelity": "fast"}, "base variants only"),
    ],
)
def test_ape_is_refused_where_it_cannot_keep_the_promise(client, fields, words):
    body = ask(client, status=422, ape=True, **fields)
    assert words in str(body)


def test_ape_is_not_combined_with_packets_or_conditioned_bases(services):
    query = services.rag.query(QUESTION, mode="naive", fidelity="fast")
    for other in ("packets", "conditioned"):
        with pytest.raises(InvalidRequest, match="never measured together"):
            with_ape(dataclasses.replace(query, **{other: True}))


def test_the_schema_asks_ape_for_fast_base_readers_without_packets_or_conditioned_bases():
    from app.api.openapi import add_ape_rule
    from app.settings import Settings

    schemas = {
        name: {"properties": {"ape": {"type": "boolean"}}} for name in ("AskRequest", "ChatRequest")
    }
    add_ape_rule(schemas, Settings(default_mode="cachecraft", fidelity="balanced"))
    (rule,) = schemas["ChatRequest"]["allOf"]
    assert rule["if"]["properties"] == {"ape": {"const": True}}
    then = rule["then"]
    assert then["properties"]["packets"] == then["properties"]["conditioned"] == {"const": False}
    assert then["properties"]["fidelity"] == {"enum": ["fast"]}
    assert set(then["required"]) == {"mode", "fidelity"}
