"""The fidelity knob through the API and the CLI, on the tiny model.

The module's server defaults to `balanced` with a margin no first token reaches and its reuse
profile off, so a balanced request always blends and re-runs in full: what the report says must
follow. A server on the default profile (the tiny model has none) answers balanced requests
exact-first, and says so in the report and in /readyz.
"""

from __future__ import annotations

import typing

import pytest

from app.cli.ask import guard_line
from app.schemas.ask import Fidelity
from engine.config import FIDELITIES
from tests.app.conftest import LOCAL_CLIENT, start_services

QUESTION = "When was the lighthouse first lit?"


@pytest.fixture(scope="module")
def client(tiny_loaded, embedder, tmp_path_factory):
    from fastapi.testclient import TestClient

    from app.main import create_app

    services = start_services(
        tiny_loaded,
        embedder,
        tmp_path_factory.mktemp("guard"),
        fidelity="balanced",
        guard_margin=1e9,
        reuse_profile="off",
    )
    with TestClient(create_app(services=services), client=LOCAL_CLIENT) as client:
        yield client
    services.close()


def test_without_a_profile_balanced_is_exact_first_and_readyz_says_so(
    tiny_loaded, embedder, tmp_path
):
    from fastapi.testclient import TestClient

    from app.main import create_app

    services = start_services(tiny_loaded, embedder, tmp_path, fidelity="balanced")
    try:
        with TestClient(create_app(services=services), client=LOCAL_CLIENT) as client:
            guard = ask(client)["guard"]
            profile = client.get("/readyz").json()["reuse_profile"]
    finally:
        services.close()
    assert guard["exact_first"] and not guard["escalated"] and guard["margin"] is None
    assert "reuse profile" in guard["estimate"]
    assert profile["exact_first"] and profile["balanced_modes"] == []
    assert profile["source"] == "none" and "calibrate profile" in profile["summary"]


def ask(client, **fields) -> dict:
    response = client.post(
        "/ask", json={"question": QUESTION, "top_k": 3, "mode": "cacheblend", **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_the_schema_names_every_level():
    assert typing.get_args(Fidelity) == FIDELITIES


def test_modes_list_the_levels_and_the_default(client):
    body = client.get("/modes").json()
    assert body["fidelities"] == list(FIDELITIES) and body["fidelity"] == "balanced"


def test_balanced_reports_its_estimate_and_the_full_rerun(client):
    body = ask(client)
    guard = body["guard"]
    assert guard["fidelity"] == "balanced" and guard["escalated"] is True
    assert guard["margin"] >= 0 and guard["threshold"] == 1e9
    assert "may leave full prefill's reorder floor; re-ran in full" in guard["estimate"]
    assert 0 < guard["spent_ms"] <= body["timings"]["ttft_ms"]
    assert body["mode"] == "cacheblend" and {c["strategy"] for c in body["chunks"]} == {"full"}
    # the re-run kept the first chunk (its base variant is exact there) and computed the rest
    assert [c["compute_share"] for c in body["chunks"]] == [0.0] + [1.0] * (len(body["chunks"]) - 1)
    assert 0 < body["usage"]["recompute_share"] < 1.0


def test_fast_keeps_the_mode(client):
    body = ask(client, fidelity="fast")
    guard = body["guard"]
    assert guard["fidelity"] == "fast" and guard["escalated"] is False and guard["spent_ms"] == 0
    assert {c["strategy"] for c in body["chunks"]} == {"cacheblend"}
    assert body["usage"]["recompute_share"] < 1.0


def test_exact_is_full_prefill(client):
    body = ask(client, fidelity="exact")
    assert body["guard"]["fidelity"] == "exact" and body["guard"]["margin"] is None
    assert body["usage"]["recompute_share"] == 1.0
    full = ask(client, mode="full", fidelity="fast")
    assert body["answer"] == full["answer"]


def test_unknown_level_is_422(client):
    response = client.post("/ask", json={"question": QUESTION, "fidelity": "perfect"})
    assert response.status_code == 422
    assert "fidelity" in response.text


def test_chat_takes_the_level_as_an_extra(client):
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": QUESTION}],
            "mode": "cacheblend",
            "fidelity": "exact",
            "max_tokens": 4,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["kvmosaic"]["guard"]["fidelity"] == "exact"


def test_cli_guard_line():
    line = guard_line(
        {
            "fidelity": "balanced",
            "margin": 0.31,
            "threshold": 1.0,
            "escalated": True,
            "spent_ms": 812.0,
        }
    )
    assert line == "fidelity balanced: first-token margin 0.31 nats; re-ran in full (812 ms)"
    assert guard_line(
        {
            "fidelity": "exact",
            "margin": None,
            "threshold": None,
            "escalated": False,
            "spent_ms": 0.0,
        }
    ).endswith("kept the mode's prefill")
    assert guard_line(
        {
            "fidelity": "balanced",
            "margin": None,
            "threshold": 1.0,
            "escalated": False,
            "spent_ms": 0.0,
            "skipped_blend": True,
        }
    ).endswith("computed exactly after the exact prefix")


@pytest.fixture(scope="module")
def repairing_client(tiny_loaded, embedder, tmp_path_factory):
    """Balanced with the first-token check off and a check while decoding that always fires."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    services = start_services(
        tiny_loaded,
        embedder,
        tmp_path_factory.mktemp("repair"),
        fidelity="balanced",
        guard_margin=0.0,
        guard_answer_margin=1e9,
        reuse_profile="off",
    )
    with TestClient(create_app(services=services), client=LOCAL_CLIENT) as client:
        yield client
    services.close()


def test_balanced_reports_the_repair_while_decoding(repairing_client):
    body = ask(repairing_client, max_tokens=6)
    guard = body["guard"]
    assert guard["escalated"] is False and guard["repaired_at"] == 1
    assert guard["repair_margin"] >= 0 and guard["repair_ms"] > 0
    assert body["timings"]["ttft_ms"] < body["timings"]["total_ms"]
    fast = ask(repairing_client, max_tokens=6, fidelity="fast")["guard"]
    assert fast["repaired_at"] is None and fast["repair_ms"] == 0
    assert guard_line(guard).endswith(f"went on from full prefill ({guard['repair_ms']:.0f} ms)")
