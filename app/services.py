"""Everything the server holds for its lifetime, built once at start-up and closed at shutdown.

Start-up order: model → catalog (migrated to head, under a lock other replicas wait on) →
KV store and chunk cache (reconciled; orphan KV only after a grace period) → embedder →
vector index (loaded, or rebuilt from the catalog's stored embeddings if missing or stale,
then following the catalog's change log) → removal of documents whose ingest lease expired
(never a peer's live ingest) → work queue → the replica daemon (index follower, lease
reclaimer, orphan sweep). Tests build `Services` from a tiny model.

A volume that cannot write does not stop the start: the catalog opens read-only, a vector
index that cannot be saved is served from memory, and both show as degraded (`write_states`,
in /readyz and /metrics) until the daemon's retry finds they can write again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from app.catalog import Catalog, CatalogUnwritable
from app.counters import Counters
from app.ingest import Ingestor
from app.kvcache.chunk_cache import CONDITIONED, ServiceChunkCache, open_chunk_cache
from app.kvcache.conditioned import BaseConditioner
from app.memory import Trimmer, limit_arenas
from app.metrics import LiveCollector, Metrics, WriteState
from app.queue import WorkQueue
from app.rag import Answer, RagService
from app.replica import (
    IndexFollower,
    LeaseKeeper,
    PeriodicJob,
    ReplicaDaemon,
    index_rows,
    new_replica_id,
)
from app.settings import Settings
from engine.engine import Engine
from engine.serving.threads import in_own_thread, single_threaded, use_threads
from retrieval import Chunker, Retriever
from retrieval.embedder import Embedder

log = logging.getLogger(__name__)

# How often the index is written to disk when the follower changed it (a restart rebuilds a
# stale one from the catalog's stored embeddings, so this only bounds that work).
INDEX_SAVE_S = 60.0
# Peers may hold shorter leases than this replica: look for expired ones at least this often.
RECLAIM_EVERY_S = 5.0
PRUNE_EVERY_S = 3600.0
# The prefix tree of chunk sequences re-reads the catalog this often (peers' variants come
# and go; this replica's own changes apply at once): a stale node only costs a miss.
TREE_REFRESH_S = 5.0
# memory-only base KV: how often to try the persistent tier again (app/kvcache/persist.py)
PERSIST_RETRY_S = 30.0
# A catalog or index that could not write: how often to try a small write (a save) again.
WRITE_RETRY_S = 10.0


@dataclass
class Services:
    settings: Settings
    engine: Engine
    catalog: Catalog
    chunk_cache: ServiceChunkCache
    retriever: Retriever
    ingestor: Ingestor
    rag: RagService
    queue: WorkQueue
    metrics: Metrics = field(default_factory=Metrics)
    counters: Counters = field(default_factory=Counters)
    started_at: float = field(default_factory=time.time)
    daemon: ReplicaDaemon | None = None
    trimmer: Trimmer | None = None  # hands freed heap back to the kernel when idle (app/memory.py)

    @classmethod
    def start(
        cls, settings: Settings, engine: Engine | None = None, embedder: Embedder | None = None
    ) -> Services:
        """Load or open every component; `engine` / `embedder` given: use them (tests)."""

        started = time.perf_counter()
        limit_arenas(settings.malloc_arenas)  # before the threads below first allocate
        engine = engine or Engine.load(settings.engine_config())
        catalog = Catalog.open(settings.catalog_config())
        chunk_cache = open_chunk_cache(settings, catalog, engine)
        # no pool left here
        embedder = embedder or in_own_thread(
            partial(Embedder, settings.embedder_path, linear_kernel=settings.linear_kernel)
        )
        if engine.computes_on_scheduler:  # embeddings too run on the engine's compute thread
            embedder = embedder.running_on(engine.compute)
        retriever = open_retriever(settings, catalog, embedder)
        chunker = Chunker(token_counter(engine), settings.chunk_tokens, settings.chunk_overlap)
        leases = LeaseKeeper(
            catalog, settings.replica_id or new_replica_id(), settings.ingest_lease_s
        )
        ingestor = Ingestor(
            engine,
            chunker,
            retriever,
            catalog,
            chunk_cache,
            leases,
            settings.ingest_kv,
            conditioner_of(settings, engine, retriever, catalog, chunk_cache),
        )
        try:
            ingestor.reclaim_expired()
        except CatalogUnwritable as exc:  # a full volume: the daemon tries again
            log.error("expired ingests not removed at start-up: %s", exc)
        services = cls.assemble(settings, engine, catalog, chunk_cache, retriever, ingestor)
        services.daemon = replica_daemon(
            settings, catalog, chunk_cache, retriever, ingestor
        ).start()
        log.info(
            "kvmosaic ready in %.1f s: %d chunks indexed, model %s",
            time.perf_counter() - started,
            len(retriever),
            engine.fingerprint,
        )
        for name, state in services.write_states().items():
            if state.error is not None:
                log.error("serving degraded: the %s cannot write (%s)", name, state.error)
        return services

    @classmethod
    def assemble(
        cls,
        settings: Settings,
        engine: Engine,
        catalog: Catalog,
        chunk_cache: ServiceChunkCache,
        retriever: Retriever,
        ingestor: Ingestor,
    ) -> Services:
        # While the engine computes on its scheduler's thread, the workers only retrieve, wait
        # and stream: single-threaded, they form no OpenMP pools to slow it
        # (engine/serving/threads.py).
        # Otherwise they compute, with the engine's thread count (set, not inherited: torch's
        # process-wide count is whatever the last helper thread set).
        queue = WorkQueue(
            settings.workers,
            settings.queue_size,
            settings.retry_after_s,
            single_threaded
            if engine.computes_on_scheduler
            else partial(use_threads, engine.threads),
        )
        rag = RagService(engine, retriever, catalog, chunk_cache, settings)
        services = cls(settings, engine, catalog, chunk_cache, retriever, ingestor, rag, queue)
        rag.observe = services.observe
        # variant builds use idle capacity only: nothing builds while a request runs or waits
        chunk_cache.builder.wait_idle = queue.wait_idle
        services.metrics.add_collector(
            LiveCollector(queue, chunk_cache.tier_stats, engine.busy, services.write_states)
        )
        services.trimmer = Trimmer(lambda: queue.pending == 0, settings.trim_interval_s)
        return services

    @property
    def model_name(self) -> str:
        path = self.settings.model_path
        name = self.settings.model or (Path(path).name if path else "SmolLM2-135M-Instruct")
        return f"kvmosaic/{name}"

    def write_states(self) -> dict[str, WriteState]:
        """Whether the catalog and the local index file can write (/readyz, /metrics)."""
        index = self.retriever.index
        return {
            "catalog": WriteState(self.catalog.write_error, self.catalog.writes.failures),
            "index": WriteState(index.write_error, index.write_failures),
        }

    def observe(self, answer: Answer) -> None:
        share = answer.result.recompute_share
        self.counters.record(answer.result.mode.name, share)
        # as in the report
        ttft = answer.stages.get("load", 0.0) + answer.stages.get("prefill", 0.0)
        self.metrics.observe_answer(
            answer.result.mode.name,
            ttft,
            share,
            answer.stages,
            len(answer.decoded.token_ids),
            answer.decoded.guard,
            answer.packets,
            conditioned_reads(answer),
            answer.ape,
        )
        if self.trimmer is not None:
            self.trimmer.note_work()

    def close(self) -> None:
        """Stop following the catalog, finish running work, then close the store and the catalog."""
        if self.daemon is not None:
            self.daemon.close()
        if self.trimmer is not None:
            self.trimmer.close()
        self.queue.shutdown(wait=True)
        self.ingestor.leases.close()
        self.retriever.save()
        self.chunk_cache.close()
        self.catalog.close()


def open_retriever(settings: Settings, catalog: Catalog, embedder: Embedder) -> Retriever:
    """The local vector index, in step with the catalog at its current change sequence."""
    cursor = catalog.last_change_seq()  # first: changes after it are applied again, harmlessly
    retriever = Retriever.open(
        embedder,
        settings.index_dir,
        catalog.indexed_chunk_ids(),
        lambda: index_rows(catalog, embedder),
        config=settings.index_config(),
    )
    retriever.cursor = cursor
    return retriever


def conditioned_reads(answer: Answer) -> tuple[int, int] | None:
    """(chunks read from conditioned bases, chunks read from plain ones) of an answer that
    asked for conditioned bases; None for one that did not."""
    if not answer.conditioned:
        return None
    read = sum(label == CONDITIONED for label in answer.variants)
    return read, len(answer.variants) - read


def conditioner_of(
    settings: Settings,
    engine: Engine,
    retriever: Retriever,
    catalog: Catalog,
    chunk_cache: ServiceChunkCache,
) -> BaseConditioner | None:
    """What computes neighbour-conditioned bases here; None when they are off
    (`KVMOSAIC_CONDITIONED_NEIGHBOURS` 0)."""
    conditioning = settings.conditioning()
    if conditioning is None:
        return None
    return BaseConditioner(engine, retriever, catalog, chunk_cache, conditioning)


def replica_daemon(
    settings: Settings,
    catalog: Catalog,
    chunk_cache: ServiceChunkCache,
    retriever: Retriever,
    ingestor: Ingestor,
) -> ReplicaDaemon:
    """Follow the change log every `index_poll_s`; look for expired ingests (of any replica,
    whatever their lease) every `RECLAIM_EVERY_S` or a third of this replica's lease if
    shorter; sweep orphan KV every half grace period (at least every 10 s); save the index
    when it changed; prune the change log hourly; rebuild the prefix tree of chunk sequences
    from the catalog every `TREE_REFRESH_S` (never when `index_poll_s` is 0: no following);
    retry the writes of a degraded catalog or index every `WRITE_RETRY_S`."""
    follower = IndexFollower(catalog, retriever)
    grace = settings.kv_orphan_grace_s
    return ReplicaDaemon(
        [
            PeriodicJob("follow the catalog", settings.index_poll_s, follower.poll),
            PeriodicJob(
                "reclaim expired ingests",
                min(RECLAIM_EVERY_S, settings.ingest_lease_s / 3),
                ingestor.reclaim_expired,
            ),
            PeriodicJob(
                "sweep orphan KV",
                max(10.0, grace / 2),
                lambda: chunk_cache.cache.maintenance.sweep_orphans(grace),
            ),
            PeriodicJob("save the index", INDEX_SAVE_S, retriever.save_if_behind),
            PeriodicJob(
                "retry the writes of a degraded catalog or index",
                WRITE_RETRY_S,
                partial(recheck_writes, catalog, retriever),
            ),
            PeriodicJob("prune the change log", PRUNE_EVERY_S, follower.prune),
            PeriodicJob(
                "persist memory-only base KV", PERSIST_RETRY_S, chunk_cache.unpersisted.retry
            ),
            PeriodicJob(
                "rebuild the chunk tree",
                TREE_REFRESH_S if settings.index_poll_s > 0 else 0.0,
                chunk_cache.cache.tree.rebuild,
            ),
        ]
    )


def recheck_writes(catalog: Catalog, retriever: Retriever) -> None:
    """A degraded catalog tries a small write (reopening read-write a catalog opened
    read-only); an index whose last save failed is saved again."""
    catalog.recheck_writes()
    if retriever.index.write_error is not None:
        retriever.save()


def token_counter(engine: Engine) -> Callable[[str], int]:
    """Tokens of a text alone, as the chunker counts them."""
    tokenizer = engine.loaded.tokenizer
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
