"""`cachecraft` through the service: a first request leaves variants, the same question reuses them."""

from __future__ import annotations


def test_second_identical_request_reuses_the_variants_of_the_first(client, services):
    question = {"question": "When was the lighthouse first lit?", "top_k": 3, "mode": "cachecraft"}
    first = client.post("/ask", json=question).json()
    assert first["chunks"][0]["strategy"] == "reuse"  # alone after the prefix: exact
    assert {c["strategy"] for c in first["chunks"][1:]} <= {"deviation", "reuse", "partial", "full"}
    services.chunk_cache.builder.join()
    assert services.chunk_cache.builder.built >= 1
    second = client.post("/ask", json=question).json()
    assert [c["chunk_id"] for c in second["chunks"]] == [c["chunk_id"] for c in first["chunks"]]
    for i, chunk in enumerate(second["chunks"]):
        assert chunk["strategy"] == "reuse" and chunk["cfo"] == 0.0
        assert chunk["variant"] == ("base" if i == 0 else "after " + ",".join(
            str(c["chunk_id"]) for c in second["chunks"][:i]))
        assert chunk["recomputed"] == 0


def test_prefix_mode_reuses_exact_context_variants(client, services):
    question = {"question": "How tall is the lighthouse tower?", "top_k": 3, "mode": "cachecraft"}
    client.post("/ask", json=question)
    services.chunk_cache.builder.join()
    body = client.post("/ask", json={**question, "mode": "prefix"}).json()
    # every chunk has a variant computed after exactly the chunks before it: nothing recomputed
    assert [c["recomputed"] for c in body["chunks"]] == [0, 0, 0]
    assert body["chunks"][1]["variant"].startswith("after ")
