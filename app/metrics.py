"""Prometheus metrics of one app instance (its own registry, so several apps can coexist in tests).

Request counts and latencies are recorded by a middleware under the route template, never
the raw path, so label cardinality stays bounded. Cache hits per tier, queue depth and
whether the catalog and the local index can write are read from their owners at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from app.queue import WorkQueue
    from app.store import TierFigures
    from engine.serving.busy import BusyGate
    from engine.serving.guard import GuardReport


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
SHARE_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)


class WriteState(NamedTuple):
    """Whether a data store of the server (the catalog, the local vector index) can write:
    why its last write failed (None: it worked) and how many writes failed so far."""

    error: str | None
    failures: int


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvmosaic_http_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "kvmosaic_http_request_seconds",
            "HTTP request latency by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvmosaic_ttft_seconds",
            "Time to first token (after retrieval) by mode",
            ["mode"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "kvmosaic_stage_seconds",
            "Time per request stage",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.recompute_share = Histogram(
            "kvmosaic_recompute_share",
            "Share of context tokens recomputed",
            ["mode"],
            buckets=SHARE_BUCKETS,
            registry=r,
        )
        self.answers = Counter(
            "kvmosaic_answers", "Answered questions by mode", ["mode"], registry=r
        )
        self.packet_answers = Counter(
            "kvmosaic_packet_answers",
            "Answered questions whose chunks were read between learned packets "
            "(`packets: true`), by mode; also counted in kvmosaic_answers",
            ["mode"],
            registry=r,
        )
        self.ape_answers = Counter(
            "kvmosaic_ape_answers",
            "Answered questions whose chunks were read by APE's attention (`ape: true`), by "
            "mode; also counted in kvmosaic_answers",
            ["mode"],
            registry=r,
        )
        self.conditioned_chunks = Counter(
            "kvmosaic_conditioned_chunks",
            "Chunks of answers that asked for conditioned bases (`conditioned: true`), by what "
            "they read: `conditioned` (their conditioned base) or `plain` (none was stored: "
            "`kvmosaic condition` computes the missing ones)",
            ["read"],
            registry=r,
        )
        self.guard = Counter(
            "kvmosaic_guard_outcomes",
            "Answers by fidelity level and what the guard did "
            "(kept, exact, rerun, repaired, skipped, exact-first: engine/serving/guard.py "
            "GuardReport.outcome)",
            ["fidelity", "outcome"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "kvmosaic_generated_tokens", "Generated answer tokens", registry=r
        )
        self.rejected = Counter(
            "kvmosaic_rejected_requests", "Requests refused with 503 (queue full)", registry=r
        )
        self.abandoned = Counter(
            "kvmosaic_abandoned_requests",
            "Requests whose client disconnected before the "
            "answer, by where their work stopped: queued (dropped before the prefill), "
            "decoding (cancelled mid-answer), finished (it ended first) (app/api/abandon.py)",
            ["stage"],
            registry=r,
        )

    def observe_answer(
        self,
        mode: str,
        ttft_s: float,
        share: float,
        stages: dict[str, float],
        generated: int,
        guard: GuardReport | None = None,
        packets: bool = False,
        conditioned: tuple[int, int] | None = None,
        ape: bool = False,
    ) -> None:
        """`conditioned`: for an answer that asked for conditioned bases, how many of its chunks
        read one and how many read their plain base."""
        self.answers.labels(mode).inc()
        if packets:
            self.packet_answers.labels(mode).inc()
        if ape:
            self.ape_answers.labels(mode).inc()
        if conditioned is not None:
            self.conditioned_chunks.labels("conditioned").inc(conditioned[0])
            self.conditioned_chunks.labels("plain").inc(conditioned[1])
        if guard is not None:
            self.guard.labels(guard.fidelity.value, guard.outcome).inc()
        self.ttft.labels(mode).observe(ttft_s)
        self.recompute_share.labels(mode).observe(share)
        for stage, seconds in stages.items():
            self.stage.labels(stage).observe(seconds)
        self.generated_tokens.inc(generated)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LiveCollector(Collector):
    """Reads live figures at scrape time: queue depth, the store's per-tier counters, the
    fidelity guard's repair odds and whether the catalog and the index can write.

    `tier_stats` returns each tier's `TierFigures` by tier name; `busy` is the engine's
    `BusyGate` (None: not reported); `writes` each data store's `WriteState` by name
    ("catalog", "index"; None: not reported).
    """

    def __init__(
        self,
        queue: WorkQueue,
        tier_stats: Callable[[], Mapping[str, TierFigures]],
        busy: BusyGate | None = None,
        writes: Callable[[], Mapping[str, WriteState]] | None = None,
    ):
        self.queue = queue
        self.tier_stats = tier_stats
        self.busy = busy
        self.writes = writes

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "kvmosaic_queue_requests", "Requests in the work queue", labels=["state"]
        )
        depth.add_metric(["running"], self.queue.running)
        depth.add_metric(["waiting"], self.queue.waiting)
        yield depth
        if self.busy is not None:
            yield GaugeMetricFamily(
                "kvmosaic_guard_repair_share",
                "Share of recent blended balanced requests that needed a full prefill anyway "
                "(re-run or repaired); at or above KVMOSAIC_GUARD_BUSY_REPAIR_SHARE a busy "
                "server skips such blends (engine/serving/busy.py)",
                value=self.busy.odds.share,
            )
        stats = self.tier_stats()
        lookups = CounterMetricFamily(
            "kvmosaic_cache_lookups",
            "KV store lookups by tier and result",
            labels=["tier", "result"],
        )
        size = GaugeMetricFamily("kvmosaic_cache_bytes", "KV bytes held per tier", labels=["tier"])
        entries = GaugeMetricFamily(
            "kvmosaic_cache_entries", "KV entries held per tier", labels=["tier"]
        )
        corrupt = CounterMetricFamily(
            "kvmosaic_cache_corrupt",
            "KV entries found corrupt (recomputed) per tier",
            labels=["tier"],
        )
        evictions = CounterMetricFamily(
            "kvmosaic_cache_evictions", "KV entries evicted per tier", labels=["tier"]
        )
        up = GaugeMetricFamily(
            "kvmosaic_store_tier_up",
            "1 while a store tier is reachable, 0 while it is down and skipped (degraded)",
            labels=["tier"],
        )
        writable = GaugeMetricFamily(
            "kvmosaic_store_tier_writable",
            "1 while a store tier takes writes, 0 while it is degraded (its last write "
            "failed, e.g. no space left) or down",
            labels=["tier"],
        )
        put_failures = CounterMetricFamily(
            "kvmosaic_cache_put_failures",
            "KV writes a store tier refused (no space, I/O errors)",
            labels=["tier"],
        )
        for tier, s in stats.items():
            up.add_metric([tier], 1 if s["available"] else 0)
            writable.add_metric([tier], 1 if s["writable"] else 0)
            put_failures.add_metric([tier], s["put_failures"])
            lookups.add_metric([tier, "hit"], s["hits"])
            lookups.add_metric([tier, "miss"], s["misses"])
            size.add_metric([tier], s["bytes"])
            entries.add_metric([tier], s["entries"])
            corrupt.add_metric([tier], s["corrupt"])
            evictions.add_metric([tier], s["evictions"])
        yield from (lookups, size, entries, corrupt, evictions, up, writable, put_failures)
        if self.writes is not None:
            yield from _write_families(self.writes())


def _write_families(states: Mapping[str, WriteState]) -> Iterator[Metric]:
    """`kvmosaic_data_writable` and `kvmosaic_data_write_failures_total` by data store, as
    the store tiers' `writable` and `put_failures` are."""
    writable = GaugeMetricFamily(
        "kvmosaic_data_writable",
        "1 while the catalog (target=catalog) or the local vector index file (target=index) "
        "takes writes, 0 while its last write failed (no space left, a read-only volume): "
        "degraded, serving reads",
        labels=["target"],
    )
    failures = CounterMetricFamily(
        "kvmosaic_data_write_failures",
        "Writes the catalog or the vector index file failed (no space, I/O errors)",
        labels=["target"],
    )
    for target, state in states.items():
        writable.add_metric([target], 0 if state.error else 1)
        failures.add_metric([target], state.failures)
    yield from (writable, failures)
