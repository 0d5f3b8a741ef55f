"""A persistent tier that is down or cannot write (a full disk): base KV goes to the next
persistent tier (or memory, said so, and persisted once the tier writes again), and `/readyz`,
`/admin/stats` and `/metrics` show the tier as degraded while the replica stays ready."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.app.conftest import ADMIN_TOKEN, DOCS, LOCAL_CLIENT, start_services
from tests.app.store.faults import NO_SPACE, FullDisk

DEAD_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def degraded(tiny_loaded, embedder, tmp_path, request):
    services = start_services(
        tiny_loaded, embedder, tmp_path, docs=[], store_tiers=request.param, redis_url=DEAD_REDIS
    )
    yield services
    services.close()


@pytest.mark.parametrize("degraded", [("cpu", "redis", "disk")], indirect=True)
def test_base_kv_goes_to_the_next_persistent_tier(degraded):
    result = degraded.ingestor.ingest(DOCS[0])
    assert result.kv_tiers == {"disk": result.document.num_chunks}
    for chunk in degraded.catalog.chunks_of_document(result.document.id):
        (variant,) = degraded.catalog.variants_of_chunk(chunk.id)
        assert variant.tier == "disk"


@pytest.mark.parametrize("degraded", [("cpu", "redis")], indirect=True)
def test_with_no_persistent_tier_left_the_ingest_says_where_kv_went(degraded):
    result = degraded.ingestor.ingest(DOCS[1])
    assert result.created and result.kv_tiers == {"cpu": result.document.num_chunks}
    with TestClient(create_app(services=degraded)) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200
        body = ready.json()
        assert body["ready"] is True and body["degraded"] == ["redis"]
        assert body["tiers"] == {"cpu": "up", "redis": "down"}
        metrics = client.get("/metrics").text
    assert 'kvmosaic_store_tier_up{tier="redis"} 0.0' in metrics
    assert 'kvmosaic_store_tier_up{tier="cpu"} 1.0' in metrics


@pytest.mark.parametrize("degraded", [("cpu", "disk")], indirect=True)
def test_a_full_disk_is_degraded_everywhere_and_its_kv_is_persisted_once_it_writes(
    degraded, monkeypatch
):
    """The fault injector makes every disk write fail with ENOSPC (issue #42: a 6 MiB tmpfs)."""
    store = degraded.chunk_cache.store
    store.retry_s = 0.0  # try the disk again at each chance, so the recovery shows at once
    disk = store.tier("disk")
    monkeypatch.setattr(disk, "__class__", FullDisk)  # the same files, writes that can fail
    disk.full = True
    with TestClient(create_app(services=degraded), client=LOCAL_CLIENT) as client:
        added = client.post("/documents", json={"text": DOCS[2].text, "title": "Bees"}).json()
        chunks = added["document"]["num_chunks"]
        assert added["kv_tiers"] == {"cpu": chunks} and added["kv_memory_only"] == chunks
        assert "memory only" in added["warning"]

        ready = client.get("/readyz").json()
        assert ready["ready"] is True and ready["tiers"]["disk"] == "degraded"
        assert ready["degraded"] == ["disk"]
        assert NO_SPACE in ready["write_errors"]["disk"]
        tier = client.get("/admin/stats", headers=ADMIN).json()["tiers"]["disk"]
        assert tier["state"] == "degraded" and tier["writable"] is False
        assert tier["put_failures"] >= 1
        assert 'kvmosaic_store_tier_writable{tier="disk"} 0.0' in client.get("/metrics").text

        disk.full = False  # space freed: the daemon's periodic job copies the KV to disk
        assert degraded.chunk_cache.unpersisted.retry() == chunks
        keys = [
            v.store_key
            for c in degraded.catalog.chunks_of_document(added["document"]["id"])
            for v in degraded.catalog.variants_of_chunk(c.id)
        ]
        assert len(keys) == chunks and all(disk.contains(key) for key in keys)
        assert client.get("/readyz").json()["degraded"] == []
        assert 'kvmosaic_store_tier_writable{tier="disk"} 1.0' in client.get("/metrics").text
