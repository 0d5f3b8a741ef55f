"""Store fixtures: one factory per tier, a private Redis namespace per test.

Redis (127.0.0.1:6379, or KVMOSAIC_TEST_REDIS_URL) gets a unique key prefix per test and
every key under it is deleted afterwards; if Redis is unreachable those tests skip.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from app.store import StoreConfig, create_tier

REDIS_URL = os.environ.get("KVMOSAIC_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
TIER_NAMES = [
    "cpu",
    "disk",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param(
        "gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.fixture
def redis_prefix():
    """A private key prefix in the real Redis, cleaned up after; skipped if unreachable."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {exc}")
    prefix = f"kvmosaic-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def store_config(tmp_path, request):
    """A StoreConfig with a private disk dir and (when the test uses Redis) a private prefix."""
    prefix = (
        request.getfixturevalue("redis_prefix")
        if request.node.get_closest_marker("redis")
        else "unused:"
    )
    return StoreConfig(
        tiers=("cpu", "disk"),
        disk_dir=tmp_path / "kv",
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        cpu_bytes=1 << 30,
        disk_bytes=1 << 30,
        redis_bytes=1 << 30,
        gpu_bytes=1 << 30,
        disk_fsync=False,
        load_threads=2,
    )


@pytest.fixture(params=TIER_NAMES)
def tier(request, store_config):
    tier = create_tier(request.param, store_config)
    yield tier
    tier.close()
