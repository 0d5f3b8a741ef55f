"""Neighbour-conditioned bases through the server: an eager ingest stores each chunk's KV
computed after its nearest chunks' openings, a request that asks (`conditioned: true`) reads
them, no exact source ever does, and `backfill` fills in a corpus ingested without them (tiny
model: the path is tested, not the answers' quality)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from app.kvcache.variants import ChunkRef
from app.rag import with_conditioned
from app.retrieve import chunk_token_ids
from app.store import chunk_from_entry, entry_from_chunk
from app.variants.conditioned import Conditioning
from engine.errors import InvalidRequest
from retrieval import SourceDocument
from tests.app.conftest import DOCS, make_settings, start_services

QUESTION = "When was the lighthouse first lit?"
CONDITIONING = Conditioning(2, 8)


@pytest.fixture(scope="module")
def services(tiny_loaded, embedder, tmp_path_factory):
    """The module's server, conditioning bases on 2 neighbours' first 8 tokens."""
    services = start_services(
        tiny_loaded,
        embedder,
        tmp_path_factory.mktemp("conditioned-data"),
        conditioned_neighbours=CONDITIONING.neighbours,
        conditioned_lead_tokens=CONDITIONING.lead_tokens,
    )
    yield services
    services.close()


def ask(client, status=200, **fields):
    response = client.post("/ask", json={"question": QUESTION, "top_k": 3, **fields})
    assert response.status_code == status, response.text
    return response.json()


def conditioned_of(services, chunk_id):
    """The chunk's conditioned bases in the catalog."""
    variants = services.catalog.variants_of_chunk(chunk_id, services.engine.fingerprint)
    return [v for v in variants if v.is_conditioned]


def expected_leads(services) -> dict[int, tuple[int, ...]]:
    """Each chunk's two nearest chunks by the stored embeddings, nearest last, among the
    chunks ingested up to its own document (ingest draws from the index as it stood)."""
    chunks = list(services.catalog.iter_indexed_chunks())
    documents = {
        c.id: c.document_id for c in services.catalog.get_chunks([c.chunk_id for c in chunks])
    }
    vectors = {c.chunk_id: np.frombuffer(c.embedding, dtype="<f4") for c in chunks}
    leads = {}
    for chunk in chunks:
        pool = [
            c
            for c in chunks
            if documents[c.chunk_id] <= documents[chunk.chunk_id]
            and c.chunk_id != chunk.chunk_id
            and c.text != chunk.text
        ]
        pool.sort(key=lambda c: -float(vectors[c.chunk_id] @ vectors[chunk.chunk_id]))
        leads[chunk.chunk_id] = tuple(c.chunk_id for c in reversed(pool[:2]))
    return leads


def test_modes_say_how_bases_are_conditioned(client):
    assert client.get("/modes").json()["conditioned"] == {"neighbours": 2, "lead_tokens": 8}


def test_ingest_stores_one_conditioned_base_per_chunk_after_its_nearest_chunks(services):
    leads = expected_leads(services)
    assert len(leads) > len(DOCS)  # some documents have several chunks
    for chunk_id, lead in leads.items():
        variants = conditioned_of(services, chunk_id)
        assert [(v.lead, v.context) for v in variants] == ([(lead, ())] if lead else [])
    assert len(leads[min(leads)]) < 2  # the first chunk ingested had one other chunk at most
    assert sum(len(lead) == 2 for lead in leads.values()) >= len(leads) - 2


def test_the_stored_kv_is_the_chunk_encoded_after_its_neighbours_openings(services):
    engine, keys = services.engine, services.chunk_cache.cache.variants.keys
    chunk = max(services.catalog.iter_indexed_chunks(), key=lambda c: c.chunk_id)
    (variant,) = conditioned_of(services, chunk.chunk_id)
    neighbours = services.catalog.get_chunks(list(variant.lead))
    titles = {d.id: d.title for d in services.catalog.list_documents(limit=50)}
    lead_ids = tuple(
        t for n in neighbours for t in chunk_token_ids(engine, n.text, titles[n.document_id])[:8]
    )
    token_ids = chunk_token_ids(engine, chunk.text, chunk.title)
    fresh = engine.encode_after(token_ids, lead_ids, variant.lead)
    codec = keys.codec(())
    expected = chunk_from_entry(entry_from_chunk(fresh, codec), token_ids, fresh.kv.dtype)
    loaded = services.chunk_cache.cache.loader.load(
        [ChunkRef(chunk.chunk_id, token_ids, conditioning=CONDITIONING.tag)]
    )
    try:
        source = loaded.inputs[0].kv
        assert source.lead == variant.lead and loaded.computed == []
        for layer in range(engine.loaded.spec.num_layers):  # packed at ingest: float rounding
            torch.testing.assert_close(
                source.layer(layer), expected.layer(layer), rtol=1e-2, atol=1e-3
            )
        plain = engine.encode_chunk(token_ids)
        plain_v = plain.kv[1][1].to(expected.kv.dtype)  # differs beyond the tolerance above
        assert not torch.allclose(expected.layer(1)[1], plain_v, rtol=1e-2, atol=1e-3)
    finally:
        loaded.close()


def test_a_request_that_asks_reads_the_conditioned_bases(client):
    plain = ask(client, mode="naive")
    conditioned = ask(client, mode="naive", conditioned=True)
    assert conditioned["conditioned"] and not plain["conditioned"]
    assert [c["chunk_id"] for c in conditioned["chunks"]] == [
        c["chunk_id"] for c in plain["chunks"]
    ]
    assert {c["variant"] for c in plain["chunks"]} == {"base"}
    assert {c["variant"] for c in conditioned["chunks"]} == {"conditioned base"}
    assert all(c["cached"] and c["recomputed"] == 0 for c in conditioned["chunks"])
    blended = ask(client, mode="cacheblend", conditioned=True)
    assert {c["variant"] for c in blended["chunks"]} == {"conditioned base"}


def test_no_exact_source_reads_a_conditioned_base(client, services):
    for _ in range(3):  # cachecraft keeps and reuses the exact rows of a recurring chunk set
        body = ask(client, mode="cachecraft")
        assert "conditioned base" not in {c["variant"] for c in body["chunks"]}
        body = ask(client, mode="prefix")
        assert "conditioned base" not in {c["variant"] for c in body["chunks"]}
    tree = services.chunk_cache.cache.tree
    conditioned = [
        v.store_key
        for chunk in services.catalog.iter_indexed_chunks()
        for v in conditioned_of(services, chunk.chunk_id)
    ]
    assert conditioned and tree.rebuild() > 0
    assert not any(key in tree._paths for key in conditioned)


def counted(client, read: str) -> float:
    name = f'kvmosaic_conditioned_chunks_total{{read="{read}"}}'
    line = next((x for x in client.get("/metrics").text.splitlines() if x.startswith(name)), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def test_a_chunk_without_its_conditioned_base_is_served_its_plain_base(client, services):
    first = ask(client, mode="naive", conditioned=True)["chunks"][0]
    (variant,) = conditioned_of(services, first["chunk_id"])
    assert services.chunk_cache.store.remove(variant.store_key)
    before = counted(client, "conditioned"), counted(client, "plain")
    chunks = ask(client, mode="naive", conditioned=True)["chunks"]
    assert chunks[0]["chunk_id"] == first["chunk_id"] and chunks[0]["variant"] == "base"
    assert {c["variant"] for c in chunks[1:]} == {"conditioned base"}
    after = counted(client, "conditioned"), counted(client, "plain")
    assert after == (before[0] + len(chunks) - 1, before[1] + 1)
    ask(client, mode="naive")  # a request that did not ask counts nowhere
    assert (counted(client, "conditioned"), counted(client, "plain")) == after


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"mode": "naive", "fidelity": "balanced"}, "fidelity 'fast' only"),
        ({"mode": "cachecraft"}, "reads base variants only"),
        ({"mode": "prefix"}, "reads base variants only"),
        ({"mode": "naive", "packets": True}, "no learned packets"),
    ],
)
def test_a_request_that_conditioned_bases_cannot_serve_is_refused(client, fields, words):
    body = ask(client, status=422, conditioned=True, **fields)
    assert words in str(body)


def test_a_server_without_conditioning_refuses_the_request(tmp_path, services):
    query = services.rag.query(QUESTION, mode="naive")
    off = make_settings(tmp_path)
    with pytest.raises(InvalidRequest, match="KVMOSAIC_CONDITIONED_NEIGHBOURS is 0"):
        with_conditioned(query, off)
    with pytest.raises(InvalidRequest, match="never measured together"):
        with_conditioned(dataclasses.replace(query, packets=True), services.settings)


def test_backfill_computes_what_a_lazy_ingest_left_and_resumes(services):
    doc = SourceDocument(
        "test:orchard",
        "The quince orchard",
        "The quince orchard at Marrow Farm was planted in 1921 with forty trees. Its fruit is "
        "picked in late October and pressed into a pale cider at the farm's own mill.",
    )
    result = services.ingestor.ingest(doc, kv="lazy")
    new = [c.id for c in services.catalog.chunks_of_document(result.document.id)]
    assert result.kv_conditioned == 0 and all(not conditioned_of(services, c) for c in new)
    conditioner = services.ingestor.conditioner
    tokens: list[int] = []
    stored, present = conditioner.backfill(tokens.append)
    # the new chunks, and any whose base left the store (the test above removed one)
    assert stored >= len(new) and present >= len(DOCS) and len(tokens) == stored
    assert all(len(conditioned_of(services, c)) == 1 for c in new)
    assert conditioner.backfill() == (0, stored + present)
    services.ingestor.delete(result.document.id)
    assert all(not services.catalog.variants_of_chunk(c) for c in new)


def test_a_request_valid_by_the_schema_is_answered_with_or_without_conditioned_bases(services):
    from tests.app.test_schemathesis import assert_valid_asks_are_answered

    assert_valid_asks_are_answered(services)


def test_the_schema_refuses_conditioned_with_packets_and_outside_fast():
    from app.api.openapi import add_conditioned_rule
    from app.settings import Settings

    schemas = {
        name: {"properties": {"conditioned": {"type": "boolean"}}}
        for name in ("AskRequest", "ChatRequest")
    }
    add_conditioned_rule(
        schemas, Settings(default_mode="cachecraft", fidelity="fast"), has_conditioning=True
    )
    (rule,) = schemas["AskRequest"]["allOf"]
    assert rule["if"]["properties"] == {"conditioned": {"const": True}}
    assert rule["then"]["properties"]["packets"] == {"const": False}
    assert rule["then"]["required"] == ["mode"]
    add_conditioned_rule(schemas, Settings(), has_conditioning=False)
    assert schemas["ChatRequest"]["properties"]["conditioned"]["enum"] == [False]


def test_an_ingest_through_the_api_says_how_many_conditioned_bases_it_stored(client):
    text = "The Kestrel footbridge spans the river Wend. It was opened in 1899 and carries walkers."
    added = client.post("/documents", json={"title": "The Kestrel bridge", "text": text})
    assert added.status_code == 201, added.text
    body = added.json()
    assert body["kv_conditioned"] == body["document"]["num_chunks"] >= 1
    lazy = client.post(
        "/documents", json={"title": "Lazy", "text": "Owls nest in the mill.", "kv": "lazy"}
    )
    assert lazy.status_code == 201 and lazy.json()["kv_conditioned"] == 0
