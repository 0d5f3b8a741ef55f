"""A persistent tier that is down: base KV goes to the next persistent tier (or memory, said so),
and `/readyz` and `/metrics` show the tier as degraded while the replica stays ready."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.app.conftest import DOCS, start_services

DEAD_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1


@pytest.fixture
def degraded(tiny_loaded, embedder, tmp_path, request):
    services = start_services(tiny_loaded, embedder, tmp_path, docs=[], store_tiers=request.param,
                              redis_url=DEAD_REDIS)
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
