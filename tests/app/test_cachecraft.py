"""Variants through the service: `cachecraft` builds them where a chunk set recurs, `prefix`
keeps what it computed, and a repeated question reuses them."""

from __future__ import annotations


def test_a_recurring_question_gets_exact_variants_built_and_reused(client, services):
    question = {"question": "When was the lighthouse first lit?", "top_k": 3, "mode": "cachecraft"}
    builder = services.chunk_cache.builder
    first = client.post("/ask", json=question).json()
    assert first["chunks"][0]["strategy"] == "reuse"  # alone after the prefix: exact
    assert {c["strategy"] for c in first["chunks"][1:]} <= {"deviation", "reuse", "partial", "full"}
    builder.join()
    assert builder.built == 0  # a chunk set seen once is not worth a build
    client.post("/ask", json=question)  # the set recurs: its exact variants are built
    builder.join()
    assert builder.built >= 1
    third = client.post("/ask", json=question).json()
    assert [c["chunk_id"] for c in third["chunks"]] == [c["chunk_id"] for c in first["chunks"]]
    for i, chunk in enumerate(third["chunks"]):
        assert chunk["strategy"] == "reuse" and chunk["cfo"] == 0.0
        assert chunk["variant"] == (
            "base"
            if i == 0
            else "after " + ",".join(str(c["chunk_id"]) for c in third["chunks"][:i])
        )
        assert chunk["recomputed"] == 0


def test_prefix_keeps_its_exact_kv_and_a_repeated_prompt_reuses_all_of_it(client, services):
    question = {"question": "How tall is the lighthouse tower?", "top_k": 3, "mode": "prefix"}
    built = services.chunk_cache.builder.built
    client.post("/ask", json=question)  # (earlier tests' requests may have left some variants)
    body = client.post("/ask", json=question).json()
    # every chunk now has a variant computed after exactly the chunks before it: nothing recomputed
    assert [c["recomputed"] for c in body["chunks"]] == [0, 0, 0]
    assert body["chunks"][1]["variant"].startswith("after ")
    assert (
        services.chunk_cache.builder.built == built
    )  # prefix never builds: it keeps what it computed


def test_a_recurring_request_computed_exactly_queues_no_build(client, services, monkeypatch):
    submitted = []
    monkeypatch.setattr(services.chunk_cache.builder, "submit", lambda *job: submitted.append(job))
    question = {
        "question": "Who kept the lighthouse?",
        "top_k": 3,
        "mode": "cachecraft",
        "fidelity": "exact",  # every chunk computed in its context: nothing left to build
    }
    for _ in range(3):  # the chunk set recurs
        assert client.post("/ask", json=question).status_code == 200
    assert submitted == []  # (a blended recurring set does queue one: the first test)
