"""`POST /ask` and `GET /modes` on the tiny model: the report says what the request did.

The chunks are checked against a brute-force cosine ranking of every ingested chunk, the
answer of `full` against the engine's own greedy answer for the same prompt, usage against
the prompt the engine lays out, and the timings against each other (never against a clock).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from app.retrieve import chunk_token_ids
from engine.config import Fidelity
from engine.decoding import read_out
from engine.model.decode import SamplingParams
from engine.plan import ChunkInput
from engine.planners import Mode, planner_names
from tests.app.conftest import DOCS

REUSE_MODES = [m for m in planner_names() if m != "full"]
STAGES = ("retrieve_ms", "load_ms", "prefill_ms", "decode_ms", "store_ms")
ROUNDING_MS = 0.05  # each timing is rounded to 0.01 ms on its own


def ask(client, **body) -> dict:
    response = client.post("/ask", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def ranked_chunks(services, question: str) -> list[tuple[int, float]]:
    """(chunk id, cosine) of every ingested chunk, best first: embedded and compared here,
    without the vector index. Embedding text as ingest writes it: title, newline, text."""
    rows = [
        (c.id, f"{d.title}\n{c.text}")
        for d in services.catalog.list_documents()
        for c in services.catalog.chunks_of_document(d.id)
    ]
    embedder = services.retriever.embedder
    scores = embedder.encode([text for _, text in rows]) @ embedder.encode([question])[0]
    order = np.argsort(-scores, kind="stable")
    return [(rows[i][0], float(scores[i])) for i in order]


def prompt_ids(services, chunk: dict) -> tuple[int, ...]:
    """The chunk's prompt ids (title, blank line, text; no title twice), from its reported text."""
    return chunk_token_ids(services.engine, chunk["text"], chunk["document"])


def engine_answer(services, question: str, chunks: list[dict], max_tokens: int):
    """The engine's own answer to the prompt of these chunks: full prefill, greedy decoding."""
    inputs = [ChunkInput(str(c["chunk_id"]), prompt_ids(services, c)) for c in chunks]
    result = services.engine.prefill(
        inputs,
        question,
        mode=Mode.named("full"),
        max_new_tokens=max_tokens,
        fidelity=Fidelity.named("fast"),
    )
    text, decoded = read_out(
        services.engine.generate(result, SamplingParams(max_new_tokens=max_tokens))
    )
    return text, result, decoded


def prompt_len(services, question: str, chunks: list[dict]) -> int:
    return services.engine.prompts.layout(
        [prompt_ids(services, c) for c in chunks], question
    ).total_len


def test_modes_come_from_the_engine_registry(client):
    body = client.get("/modes").json()
    assert body["modes"] == planner_names()
    assert body["default"] == "cacheblend" and body["top_k"] == 6


def test_ask_reports_chunks_timings_and_usage(client, services):
    question = "When was the lighthouse first lit?"
    body = ask(client, question=question, top_k=3, max_tokens=8)
    assert body["mode"] == "cacheblend"  # the server's default

    # chunks: the three closest to the question, best first, each from an ingested document
    ranked = ranked_chunks(services, question)[:3]
    assert [c["chunk_id"] for c in body["chunks"]] == [chunk_id for chunk_id, _ in ranked]
    assert [c["score"] for c in body["chunks"]] == pytest.approx([s for _, s in ranked], abs=1e-3)
    assert body["chunks"][0]["document"] == "Hollin Point Lighthouse"
    docs = {d.source: d for d in DOCS}
    for chunk in body["chunks"]:
        doc = docs[chunk["source"]]
        assert chunk["document"] == doc.title and chunk["text"] in doc.text
        assert chunk["tokens"] == len(prompt_ids(services, chunk))
        assert chunk["strategy"] == "cacheblend" and chunk["cached"] is True
        assert chunk["reused"] + chunk["recomputed"] == chunk["tokens"]
        assert chunk["variant"].startswith("base") and "stopped_layer" in chunk
        assert chunk["token_texts"] is None  # only with explain

    # timings: stages are disjoint parts of the request, so they fit in its total
    t = body["timings"]
    assert all(value >= 0 for value in t.values())
    assert t["ttft_ms"] == pytest.approx(t["load_ms"] + t["prefill_ms"], abs=0.02)
    assert sum(t[stage] for stage in STAGES) <= t["total_ms"] + ROUNDING_MS

    # usage: the prompt the engine lays out for these chunks, the answer within its budget
    u = body["usage"]
    assert u["prompt_tokens"] == prompt_len(services, question, body["chunks"])
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["context_tokens"] == sum(c["tokens"] for c in body["chunks"])
    assert u["recomputed_tokens"] == sum(c["recomputed"] for c in body["chunks"])
    assert u["recompute_share"] == round(u["recomputed_tokens"] / u["context_tokens"], 4)
    assert 1 <= u["completion_tokens"] <= 8 and body["answer"]
    assert body["finish_reason"] == ("length" if u["completion_tokens"] == 8 else "stop")


@pytest.mark.parametrize("mode", planner_names())
def test_every_registered_mode_answers(client, services, mode):
    question = "How long is the ferry crossing?"
    body = ask(client, question=question, mode=mode, top_k=2, max_tokens=4)
    assert body["mode"] == mode and body["answer"]
    ranked = ranked_chunks(services, question)[:2]
    assert [c["chunk_id"] for c in body["chunks"]] == [chunk_id for chunk_id, _ in ranked]
    if mode != "cachecraft":  # cachecraft names its per-chunk choice instead (reuse, partial, ...)
        assert all(c["strategy"] == mode for c in body["chunks"])
    share = body["usage"]["recompute_share"]
    if mode == "full":  # reads no cached KV at all
        assert all(c["recomputed"] == c["tokens"] and not c["cached"] for c in body["chunks"])
        assert {c["variant"] for c in body["chunks"]} == {"none (full prefill)"}
        assert share == 1.0
    elif mode == "naive":
        assert all(c["recomputed"] == 0 for c in body["chunks"]) and share == 0.0
    else:
        assert 0.0 <= share <= 1.0


def test_full_answers_what_the_engine_answers_greedily(client, services):
    question = "When was the mill built?"
    body = ask(client, question=question, mode="full", top_k=2, max_tokens=6)
    expected, result, decoded = engine_answer(services, question, body["chunks"], 6)
    assert body["answer"] == expected and expected
    assert body["usage"]["completion_tokens"] == len(decoded.token_ids)
    assert body["usage"]["prompt_tokens"] == result.layout.total_len


def test_full_recomputes_everything_and_reuse_modes_less_on_a_repeat(client):
    question = {"question": "What does the waggle run show?", "top_k": 2, "max_tokens": 2}
    assert ask(client, **question, mode="full")["usage"]["recompute_share"] == 1.0
    for mode in REUSE_MODES:
        ask(client, **question, mode=mode)  # a first time: whatever the mode keeps is stored
        usage = ask(client, **question, mode=mode)["usage"]
        assert usage["recompute_share"] < 1.0, mode
        assert usage["recomputed_tokens"] < usage["context_tokens"], mode
        if mode == "prefix":  # it kept the KV it computed in exactly this context: nothing to redo
            assert usage["recompute_share"] == 0.0


def test_modes_agree_on_the_prompt(client, services):
    """Every mode runs on the same token sequence: the one the engine lays out."""
    bodies = [
        ask(client, question="Who dances?", mode=m, top_k=2, max_tokens=2)
        for m in ("full", "cacheblend", "naive")
    ]
    expected = prompt_len(services, "Who dances?", bodies[0]["chunks"])
    assert [b["usage"]["prompt_tokens"] for b in bodies] == [expected] * 3


@pytest.mark.parametrize("mode", ["cacheblend", "full"])
def test_explain_adds_tokens_and_recomputed_offsets(client, mode):
    body = ask(
        client, question="What did the lamp burn?", mode=mode, top_k=2, explain=True, max_tokens=2
    )
    for chunk in body["chunks"]:
        assert len(chunk["token_texts"]) == chunk["tokens"]
        assert chunk["text"] in "".join(chunk["token_texts"])  # the chunk's own tokens, in order
        offsets = chunk["recomputed_offsets"]
        assert offsets == sorted(set(offsets)) and len(offsets) == chunk["recomputed"]
        assert all(0 <= i < chunk["tokens"] for i in offsets)
        if mode == "full":
            assert offsets == list(range(chunk["tokens"]))


def test_greedy_answers_repeat(client):
    question = {"question": "When was the mill built?", "top_k": 2, "max_tokens": 6}
    first, second = ask(client, **question), ask(client, **question)
    assert first["answer"] and first["answer"] == second["answer"]
    assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"]


def test_max_tokens_bounds_the_answer(client):
    question = {"question": "Tell me everything.", "top_k": 1}
    short, longer = ask(client, **question, max_tokens=3), ask(client, **question, max_tokens=8)
    completion = short["usage"]["completion_tokens"]
    assert 1 <= completion <= 3
    assert short["finish_reason"] == ("length" if completion == 3 else "stop")
    assert longer["answer"].startswith(short["answer"])  # greedy: the budget only cuts the answer
    assert longer["usage"]["completion_tokens"] >= completion


def metric(text: str, sample: str) -> float:
    """The value of one exposition line, 0 if the sample is not there yet."""
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_health_ready_and_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    requests = 'kvmosaic_http_requests_total{method="POST",route="/ask",status="200"}'
    answers = 'kvmosaic_answers_total{mode="cacheblend"}'
    before = client.get("/metrics").text
    body = ask(client, question="Where does the ferry go?", top_k=1, max_tokens=2)
    text = client.get("/metrics").text
    assert metric(text, requests) == metric(before, requests) + 1
    assert metric(text, answers) == metric(before, answers) + 1
    guard = body["guard"]
    outcome = (
        "skipped"
        if guard["skipped_blend"]
        else "rerun"
        if guard["escalated"]
        else "repaired"
        if guard["repaired_at"] is not None
        else "exact"
        if guard["margin"] is None
        else "kept"
    )
    sample = f'kvmosaic_guard_outcomes_total{{fidelity="{guard["fidelity"]}",outcome="{outcome}"}}'
    assert metric(text, sample) == metric(before, sample) + 1
    assert 0 < metric(text, "kvmosaic_guard_repair_share") < 1  # the odds, with their prior
    assert 'kvmosaic_ttft_seconds_bucket{le="0.001",mode="cacheblend"}' in text
    assert 'kvmosaic_cache_lookups_total{result="hit",tier="cpu"}' in text
    assert (
        "kvmosaic_recompute_share_bucket" in text
        and 'kvmosaic_queue_requests{state="waiting"}' in text
    )


def test_web_page_and_assets_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and "kvmosaic" in page.text and "/static/app.js" in page.text
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/static/style.css").headers["content-type"].startswith("text/css")
