"""Everything the server holds for its lifetime, built once at start-up and closed at shutdown.

Start-up order: model → catalog (migrated to head) → KV store and chunk cache → embedder →
vector index (loaded, or rebuilt from the catalog if missing or stale) → removal of
documents a crash left half-ingested → work queue. Tests build `Services` from a tiny model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.counters import Counters
from app.ingest import Ingestor, iter_chunk_texts
from app.metrics import LiveCollector, Metrics
from app.queue import WorkQueue
from app.service import Answer, RagService
from app.settings import Settings
from retrieval import Chunker, Retriever

log = logging.getLogger(__name__)


@dataclass
class Services:
    settings: Settings
    engine: object
    catalog: object
    chunk_cache: object
    retriever: Retriever
    ingestor: Ingestor
    rag: RagService
    queue: WorkQueue
    metrics: Metrics = field(default_factory=Metrics)
    counters: Counters = field(default_factory=Counters)
    started_at: float = field(default_factory=time.time)

    @classmethod
    def start(cls, settings: Settings, engine=None, embedder=None) -> "Services":
        """Load or open every component; `engine` / `embedder` given: use them (tests)."""
        from app.chunks import open_chunk_cache
        from engine.catalog import Catalog
        from engine.engine import Engine
        from retrieval.embedder import Embedder

        started = time.perf_counter()
        engine = engine or Engine.load(settings.engine_config())
        catalog = Catalog.open(settings.catalog_config())
        chunk_cache = open_chunk_cache(settings, catalog, engine)
        embedder = embedder or Embedder(settings.embedder_path)
        indexed = [chunk_id for chunk_id, _ in iter_chunk_texts(catalog)]
        retriever = Retriever.open(embedder, settings.index_dir, indexed, lambda: iter_chunk_texts(catalog))
        chunker = Chunker(token_counter(engine), settings.chunk_tokens, settings.chunk_overlap)
        ingestor = Ingestor(engine, chunker, retriever, catalog, chunk_cache)
        ingestor.remove_incomplete()
        services = cls.assemble(settings, engine, catalog, chunk_cache, retriever, ingestor)
        log.info("kvmosaic ready in %.1f s: %d chunks indexed, model %s", time.perf_counter() - started,
                 len(retriever), engine.fingerprint)
        return services

    @classmethod
    def assemble(cls, settings, engine, catalog, chunk_cache, retriever, ingestor) -> "Services":
        queue = WorkQueue(settings.workers, settings.queue_size, settings.retry_after_s)
        rag = RagService(engine, retriever, catalog, chunk_cache, settings)
        services = cls(settings, engine, catalog, chunk_cache, retriever, ingestor, rag, queue)
        rag.observe = services.observe
        services.metrics.add_collector(LiveCollector(queue, chunk_cache.tier_stats))
        return services

    @property
    def model_name(self) -> str:
        path = self.settings.model_path
        return f"kvmosaic/{Path(path).name if path else 'SmolLM2-135M-Instruct'}"

    def observe(self, answer: Answer) -> None:
        share = answer.result.recompute_share
        self.counters.record(answer.result.mode, share)
        ttft = answer.stages.get("load", 0.0) + answer.stages.get("prefill", 0.0)  # as in the report
        self.metrics.observe_answer(answer.result.mode, ttft, share, answer.stages, len(answer.result.generated_ids))

    def close(self) -> None:
        """Finish running work, then close the store and the catalog."""
        self.queue.shutdown(wait=True)
        self.retriever.save()
        self.chunk_cache.close()
        self.catalog.close()


def token_counter(engine):
    tokenizer = engine.loaded.tokenizer
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
