"""Recomputed KV stays persistent, and a recomputed chunk is reported as such (also in /metrics).

Each test gets its own services on a fresh data dir (cpu + disk tiers): what ingest put on
disk, what a cleared cache recomputes, and what a restart finds there.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.kvcache.chunk_cache import COMPUTED_NOW
from app.main import create_app
from tests.app.conftest import ADMIN_TOKEN, LOCAL_CLIENT, start_services

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ASK = {
    "question": "When was the Hollin Point Lighthouse first lit?",
    "top_k": 2,
    "max_tokens": 6,
    "mode": "cacheblend",
}


@pytest.fixture
def data_dir(tmp_path):
    return tmp_path / "data"


@pytest.fixture
def open_client(tiny_loaded, embedder, data_dir):
    """Start services on `data_dir` and drive them in-process; closes what it started."""
    opened = []

    def open_():
        services = start_services(tiny_loaded, embedder, data_dir)
        client = TestClient(create_app(services=services), client=LOCAL_CLIENT).__enter__()
        opened.append((services, client))
        return services, client

    yield open_
    for services, client in reversed(opened):
        client.__exit__(None, None, None)
        services.close()


def ask(client) -> dict:
    response = client.post("/ask", json=ASK)
    assert response.status_code == 200, response.text
    return response.json()


def test_kv_recomputed_after_a_cache_clear_goes_to_disk_and_survives_a_restart(open_client):
    services, client = open_client()
    first = ask(client)
    assert all(c["cached"] and c["variant"] == "base" for c in first["chunks"])
    assert client.delete("/admin/cache", headers=AUTH).json()["evicted_entries"] > 0

    recomputed = ask(client)
    assert all(not c["cached"] and c["variant"] == COMPUTED_NOW for c in recomputed["chunks"])
    assert recomputed["answer"] == first["answer"]
    for chunk in recomputed["chunks"]:
        (variant,) = services.catalog.variants_of_chunk(chunk["chunk_id"])
        assert variant.tier == "disk"
    assert client.get("/admin/stats", headers=AUTH).json()["tiers"]["disk"]["entries"] >= len(
        recomputed["chunks"]
    )
    client.__exit__(None, None, None)
    services.close()

    _, restarted = open_client()
    again = ask(restarted)
    assert all(
        c["cached"] and c["variant"] == "base" for c in again["chunks"]
    )  # nothing recomputed
    assert again["answer"] == first["answer"]


def corrupt_last_layer(services, chunk_id: int) -> None:
    """Flip bytes at the end of the chunk's disk file: the header stays valid, a layer does not."""
    (variant,) = services.catalog.variants_of_chunk(chunk_id)
    path = services.chunk_cache.store.tier("disk").path(variant.store_key)
    data = bytearray(path.read_bytes())
    for i in range(1, 65):
        data[-i] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt_count(client, tier: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'kvmosaic_cache_corrupt_total{{tier="{tier}"}}'):
            return float(line.split()[-1])
    raise AssertionError("kvmosaic_cache_corrupt_total is not in /metrics")


def test_a_corrupt_entry_is_reported_as_computed_now_and_counted_in_metrics(open_client):
    services, client = open_client()
    reference = client.post("/ask", json={**ASK, "mode": "full"}).json()
    chunk_id = reference["chunks"][0]["chunk_id"]
    assert corrupt_count(client, "disk") == 0
    corrupt_last_layer(services, chunk_id)  # never used yet: it lives on disk only

    hit = ask(client)
    by_id = {c["chunk_id"]: c for c in hit["chunks"]}
    assert by_id[chunk_id]["variant"] == COMPUTED_NOW and by_id[chunk_id]["cached"] is False
    assert all(c["cached"] for c in hit["chunks"] if c["chunk_id"] != chunk_id)
    assert corrupt_count(client, "disk") == 1
    stats = client.get("/admin/stats", headers=AUTH).json()["tiers"]["disk"]
    assert stats["corrupt"] == 1

    again = {c["chunk_id"]: c for c in ask(client)["chunks"]}
    assert again[chunk_id]["variant"] == "base" and again[chunk_id]["cached"] is True
