"""Admin endpoints: closed without a token, 401 with a wrong one; stats, eviction and clearing
work."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from app.main import create_app
from tests.app.conftest import ADMIN_TOKEN

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ENDPOINTS = [
    ("GET", "/admin/stats", None),
    ("POST", "/admin/evict", {"tier": "cpu"}),
    ("DELETE", "/admin/cache", None),
]


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {ADMIN_TOKEN}", "Bearer"])
def test_missing_or_wrong_token_is_401(client, method, path, body, header):
    headers = {"Authorization": header} if header else {}
    response = client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert "bearer token" in response.json()["error"]["message"]


@pytest.mark.parametrize("token", [None, SecretStr("")])
@pytest.mark.parametrize("method,path,body", ENDPOINTS)
def test_no_token_configured_means_closed(services, token, method, path, body):
    closed = dataclasses.replace(
        services, settings=services.settings.model_copy(update={"admin_token": token})
    )
    with TestClient(create_app(services=closed)) as client:
        response = client.request(method, path, json=body, headers=AUTH)
    assert (
        response.status_code == 403
        and "KVMOSAIC_ADMIN_TOKEN" in response.json()["error"]["message"]
    )


def test_stats(client):
    client.post("/ask", json={"question": "When was the lighthouse first lit?", "max_tokens": 2})
    stats = client.get("/admin/stats", headers=AUTH).json()
    assert set(stats["tiers"]) == {"cpu", "disk"}
    for tier in stats["tiers"].values():
        assert {"entries", "bytes", "capacity_bytes", "hits", "misses", "hit_rate"} <= set(tier)
    assert (
        stats["documents"] >= 4
        and stats["chunks"] >= 4
        and stats["variants"]["ready"] >= stats["chunks"]
    )
    assert stats["requests"]["answered"] >= 1 and 0 <= stats["mean_recompute_share"] <= 1
    assert stats["index_rows"] == stats["chunks"] and stats["reuse_available"] is True


def tiers(client) -> dict:
    return client.get("/admin/stats", headers=AUTH).json()["tiers"]


def test_evict_a_tier_demotes_to_the_next(client):
    client.post("/ask", json={"question": "When was the tide mill built?", "max_tokens": 2})
    before = tiers(client)
    assert before["cpu"]["entries"] > 0  # used entries were promoted from disk
    result = client.post("/admin/evict", json={"tier": "cpu"}, headers=AUTH).json()
    after = tiers(client)
    assert (
        result["evicted_entries"] == before["cpu"]["entries"]
        and result["freed_bytes"] == before["cpu"]["bytes"]
    )
    assert after["cpu"]["entries"] == 0 and after["disk"]["entries"] >= before["cpu"]["entries"]


def test_evict_bytes_by_policy_frees_at_least_that_much(client):
    client.post("/ask", json={"question": "How do bees dance?", "max_tokens": 2, "top_k": 4})
    size = tiers(client)["cpu"]["bytes"]
    result = client.post(
        "/admin/evict", json={"tier": "cpu", "bytes": 1, "policy": "lfu"}, headers=AUTH
    ).json()
    assert result["evicted_entries"] == 1 and 0 < result["freed_bytes"] <= size


def test_evict_a_chunk_everywhere_then_it_is_recomputed(client, services):
    ask = {"question": "How long is the ferry crossing?", "top_k": 1, "max_tokens": 4}
    first = client.post("/ask", json=ask).json()
    chunk_id = first["chunks"][0]["chunk_id"]
    result = client.post("/admin/evict", json={"chunk_id": chunk_id}, headers=AUTH).json()
    assert result["evicted_entries"] == 1
    assert services.catalog.variants_of_chunk(chunk_id) == []  # none ready
    again = client.post("/ask", json=ask).json()
    assert (
        again["chunks"][0]["variant"] == "base (computed now)"
        and again["answer"] == first["answer"]
    )
    assert client.post("/ask", json=ask).json()["chunks"][0]["variant"] == "base"


@pytest.mark.parametrize(
    "body,needle",
    [
        ({}, "at least one of"),
        ({"tier": "tape"}, "unknown tier 'tape'"),
        ({"bytes": 10, "policy": "random"}, "unknown policy 'random'"),
        ({"bytes": 0}, "bytes"),
    ],
)
def test_bad_evict_requests_are_422(client, body, needle):
    response = client.post("/admin/evict", json=body, headers=AUTH)
    assert response.status_code == 422 and needle in response.json()["error"]["message"]


def test_clear_cache_then_answers_are_unchanged(client, services):
    ask = {"question": "What did the lamp burn?", "top_k": 2, "max_tokens": 4}
    before = client.post("/ask", json=ask).json()
    # a build or promotion still running from earlier requests would refill a tier after the clear
    services.chunk_cache.drain()
    result = client.delete("/admin/cache", headers=AUTH).json()
    assert result["evicted_entries"] > 0 and result["freed_bytes"] > 0
    stats = client.get("/admin/stats", headers=AUTH).json()
    assert (
        all(t["entries"] == 0 for t in stats["tiers"].values()) and stats["variants"]["ready"] == 0
    )
    after = client.post("/ask", json=ask).json()
    assert after["answer"] == before["answer"]
    assert all(c["variant"] == "base (computed now)" for c in after["chunks"])
