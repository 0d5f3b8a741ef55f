"""Soak (bounded): concurrent asks in every mode, streamed and not, over real HTTP, while an admin
evicts and clears the cache underneath; small tiers so evictions also happen on their own.

Asserts: no request fails, every `full` answer equals the one computed before the load, and
RSS levels off: after the first third of the run (warm-up: first use of every code path),
it grows by less than `RSS_GROWTH_MIB`. Runs in CI (marker `soak`), ~SOAK_SECONDS seconds.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.app.conftest import ADMIN_TOKEN, free_port, start_services
from tests.app.soak import reference_answers, run_soak

pytestmark = pytest.mark.soak

SOAK_SECONDS = float(os.environ.get("KVMOSAIC_SOAK_SECONDS", "60"))
# The tiny model's working set is a few MiB; what the bound catches is growth per request
# (thousands of requests in a run), not allocator noise.
RSS_GROWTH_MIB = 48
QUESTIONS = [
    "When was the lighthouse first lit?",
    "What did the lamp burn?",
    "When was the tide mill built?",
    "How do bees tell where flowers are?",
    "How long is the ferry crossing?",
    "How many passengers?",
]


@pytest.fixture(scope="module")
def soak_url(tiny_loaded, embedder, tmp_path_factory):
    import uvicorn

    from app.main import create_app

    # cpu tier of ~3 entries: requests evict and promote on their own, besides the admin's evictions
    services = start_services(
        tiny_loaded,
        embedder,
        tmp_path_factory.mktemp("soak"),
        store_cpu_bytes=16 << 10,
        workers=2,
        queue_size=16,
        trim_interval_s=2.0,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(services=services), host="127.0.0.1", port=free_port(), log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the soak server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=30)
    services.close()


def test_soak_no_errors_full_unchanged_rss_levels_off(soak_url):
    reference = reference_answers(soak_url, QUESTIONS, max_tokens=8)
    result = run_soak(
        soak_url,
        QUESTIONS,
        reference,
        SOAK_SECONDS,
        clients=3,
        max_tokens=8,
        admin_token=ADMIN_TOKEN,
        admin_every_s=1.0,
        rss_every_s=0.5,
    )
    summary = result.summary()
    print("soak:", summary)
    assert result.requests > 30 and result.admin_actions > 10, summary
    assert result.errors == [], result.errors[:5]
    assert result.full_mismatches == [], result.full_mismatches[:5]
    warm = max(result.rss_mib(0, 1 / 3))
    late = max(result.rss_mib(2 / 3, 1))
    assert late - warm < RSS_GROWTH_MIB, summary
