"""`POST /ask` and `GET /modes` on the tiny model: the report has every promised field."""

from __future__ import annotations

import pytest

from engine.planners import planner_names


def test_modes_come_from_the_engine_registry(client):
    body = client.get("/modes").json()
    assert body["modes"] == planner_names()
    assert body["default"] == "cacheblend" and body["top_k"] == 6


def test_ask_reports_chunks_timings_and_usage(client):
    response = client.post("/ask", json={"question": "When was the lighthouse first lit?", "top_k": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["answer"], str) and body["mode"] == "cacheblend"
    assert body["finish_reason"] in ("stop", "length")
    assert len(body["chunks"]) == 3
    top = body["chunks"][0]
    assert top["document"] == "Hollin Point Lighthouse" and top["score"] > body["chunks"][-1]["score"]
    for chunk in body["chunks"]:
        assert chunk["strategy"] == "cacheblend" and chunk["cached"] is True
        assert chunk["reused"] + chunk["recomputed"] == chunk["tokens"]
        assert chunk["variant"].startswith("base") and "stopped_layer" in chunk
        assert chunk["token_texts"] is None  # only with explain
    t = body["timings"]
    assert t["ttft_ms"] == pytest.approx(t["load_ms"] + t["prefill_ms"], abs=0.02)
    assert t["total_ms"] >= t["retrieve_ms"] + t["ttft_ms"]
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["recomputed_tokens"] == sum(c["recomputed"] for c in body["chunks"])


@pytest.mark.parametrize("mode", planner_names())
def test_every_registered_mode_answers(client, mode):
    body = client.post("/ask", json={"question": "How long is the ferry crossing?", "mode": mode,
                                     "top_k": 2, "max_tokens": 4}).json()
    assert body["mode"] == mode and len(body["chunks"]) == 2
    if mode == "full":  # reads no cached KV at all
        assert all(c["recomputed"] == c["tokens"] and not c["cached"] for c in body["chunks"])
        assert {c["variant"] for c in body["chunks"]} == {"none (full prefill)"}
    if mode == "naive":
        assert all(c["recomputed"] == 0 for c in body["chunks"])


def test_modes_agree_on_the_prompt(client):
    """Every mode runs on the same token sequence, so prompt sizes match."""
    sizes = {client.post("/ask", json={"question": "Who dances?", "mode": m, "top_k": 2, "max_tokens": 2}
                         ).json()["usage"]["prompt_tokens"] for m in ("full", "cacheblend", "naive")}
    assert len(sizes) == 1


def test_explain_adds_tokens_and_recomputed_offsets(client):
    body = client.post("/ask", json={"question": "What did the lamp burn?", "top_k": 2, "explain": True,
                                     "max_tokens": 2}).json()
    for chunk in body["chunks"]:
        assert len(chunk["token_texts"]) == chunk["tokens"]
        assert len(chunk["recomputed_offsets"]) == chunk["recomputed"]
        assert all(0 <= i < chunk["tokens"] for i in chunk["recomputed_offsets"])


def test_greedy_answers_repeat(client):
    ask = {"question": "When was the mill built?", "top_k": 2, "max_tokens": 6}
    assert client.post("/ask", json=ask).json()["answer"] == client.post("/ask", json=ask).json()["answer"]


def test_max_tokens_bounds_the_answer(client):
    body = client.post("/ask", json={"question": "Tell me everything.", "max_tokens": 3,
                                     "top_k": 1}).json()
    assert body["usage"]["completion_tokens"] <= 3


def test_health_ready_and_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    client.post("/ask", json={"question": "Where does the ferry go?", "top_k": 1, "max_tokens": 2})
    text = client.get("/metrics").text
    assert 'kvmosaic_http_requests_total{method="POST",route="/ask",status="200"}' in text
    assert 'kvmosaic_ttft_seconds_bucket{le="0.001",mode="cacheblend"}' in text
    assert 'kvmosaic_cache_lookups_total{result="hit",tier="cpu"}' in text
    assert "kvmosaic_recompute_share_bucket" in text and 'kvmosaic_queue_requests{state="waiting"}' in text


def test_web_page_and_assets_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and "kvmosaic" in page.text and "/static/app.js" in page.text
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/static/style.css").headers["content-type"].startswith("text/css")
