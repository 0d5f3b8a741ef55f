"""The service's view of chunk KV: `ChunkKVCache`'s parts behind what the service asks, plus the
admin side.

What the request path needs from it: `order` (the chunks' prompt order, `order.py`: the
longest cached exact path first under `KVMOSAIC_CHUNK_ORDER=cache-aware`), `load` (the
retrieved chunks' KV, pinned, read layer by layer; a chunk with no stored KV is computed and
stored), `served` (how the prefill served each context token), `store_variants` (the KV a
request produced in a new context) and `release`. Ingest uses `put_base`; deletion uses
`forget_document`; `/admin` uses `tier_stats`, `evict` and `clear`.

Which variant each chunk uses and what a finished request leaves is the mode's policy
(`app.variants.VariantPolicy`, from the planner's `variant_use` / `leaves`): `prefix`
uses exact-context variants and keeps what it computed; `cachecraft` uses the cheapest variant
to fix, keeps its exact rows and, for chunk sets that recur, has exact variants built in the
background on idle capacity; the other modes use base variants and leave nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from app.catalog import Catalog, CatalogUnwritable, DeletedDocument, context_signature
from app.kvcache.builder import VariantBuilder
from app.kvcache.cache import ChunkKVCache
from app.kvcache.loader import LoadedChunks
from app.kvcache.order import OrderedChunks, order_retrieved
from app.kvcache.persist import Unpersisted
from app.retrieve import Retrieved
from app.settings import Settings
from app.store import LazyChunkKV, TierFigures, create_store
from app.store.config import KNOWN_POLICIES
from app.variants.build import needs_build
from app.variants.conditioned import Conditioning
from app.variants.harvest import source_contexts
from app.variants.order import ChunkOrder
from app.variants.served import ServedTokens, served_tokens
from engine.decoding import Decoded
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.kv import ChunkId, ChunkKV, KVSource
from engine.model.encoder import DEFAULT_BATCH_TOKENS, batches
from engine.plan import ChunkInput
from engine.planners import Mode
from engine.result import PrefillResult

log = logging.getLogger(__name__)

PERSISTENT_TIERS = ("disk", "redis")
COMPUTED_NOW = "base (computed now)"
IN_CONTEXT = "none (computed in context, kept)"  # a cachecraft inline build
FULL_PREFILL = "none (full prefill)"
CONDITIONED = "conditioned base"  # computed after its nearest chunks' openings (#57)


@dataclass
class RequestChunks:
    """One request's chunk inputs (in retrieval order) and which variant each one uses."""

    loaded: LoadedChunks
    reuses_cache: bool = True

    @property
    def inputs(self) -> list[ChunkInput]:
        return self.loaded.inputs

    @property
    def variant_labels(self) -> list[str]:
        """Per chunk: the variant its KV came from, `COMPUTED_NOW` if it was computed for this
        request. Read it after the prefill: an entry found corrupt while its layers are read
        is recomputed then, and that chunk was not served from the cache."""
        if not self.reuses_cache:
            return [FULL_PREFILL] * len(self.inputs)
        computed = set(self.loaded.computed) | {i.chunk_id for i in self.inputs if _fell_back(i.kv)}
        return [
            IN_CONTEXT
            if i.kv is None
            else _label(i.kv.context, i.chunk_id in computed, bool(i.kv.lead))
            for i in self.inputs
        ]

    def release(self) -> None:
        self.loaded.close()


class ServiceChunkCache:
    def __init__(self, cache: ChunkKVCache, batch_tokens: int = DEFAULT_BATCH_TOKENS):
        self.cache = cache
        self.batch_tokens = batch_tokens  # chunk rows packed into one encoding pass (put_bases)
        self.store = cache.store
        self.engine = cache.engine
        # None (no disk or Redis tier): the first tier, lost at exit.
        self.persistent_tier = first_persistent_tier(self.store.names)
        self.unpersisted = Unpersisted(
            self.store, self.persistent_tier
        )  # base KV in memory only, for now
        self.builder = VariantBuilder(cache.variants, build_threads=self.engine.build_threads)

    # -- the request path ----------------------------------------------------------------------

    def order(self, retrieved: Sequence[Retrieved], mode: Mode, rule: ChunkOrder) -> OrderedChunks:
        """The retrieved chunks in the order `rule` (`KVMOSAIC_CHUNK_ORDER`) chooses for `mode`."""
        return order_retrieved(
            self.cache.tree, retrieved, rule, self.cache.variants.policy.uses_variants(mode)
        )

    def served(self, chunks: RequestChunks, result: PrefillResult) -> ServedTokens:
        """How the prefill served the context tokens: exact, blended or computed."""
        return served_tokens(result, chunks.inputs, self.engine.loaded.spec.num_layers)

    def load(
        self, retrieved: Sequence[Retrieved], mode: Mode, conditioning: Conditioning | None = None
    ) -> RequestChunks:
        """Pinned KV sources for the retrieved chunks; computed and stored where missing.

        A mode that reuses no cache (`full`) gets no sources at all: nothing is read or
        pinned, so its TTFT is the plain prefill it stands for. `conditioning`: read each
        chunk's neighbour-conditioned base of that kind where one is stored, else its base
        (a mode that reads base variants only: `app.rag.with_conditioned`).
        """
        if not mode.reuses_cache:
            inputs = [ChunkInput(r.chunk.id, tuple(r.token_ids)) for r in retrieved]
            return RequestChunks(LoadedChunks(inputs, [], None), reuses_cache=False)
        refs = self.cache.variants.choose(
            mode, [(r.chunk.id, tuple(r.token_ids)) for r in retrieved]
        )
        if conditioning is not None:
            refs = [replace(ref, conditioning=conditioning.tag) for ref in refs]
        return RequestChunks(self.cache.loader.load(refs))

    def store_variants(
        self, chunks: RequestChunks, result: PrefillResult, decoded: Decoded
    ) -> bool:
        """What the finished request (its prefill `result`, its decode `decoded`) leaves, by its
        mode's policy: the savings its context variants brought, the exact rows it computed (at
        once: a copy), and a background build of exact variants where its chunk set recurs and
        some chunk was not exact (an all-exact request has nothing to build). True if a build
        was queued."""
        inputs = chunks.inputs
        if not result.mode.reuses_cache:
            return False
        try:
            self.cache.variants.record_savings(result, inputs)
            self.cache.variants.harvest(result, inputs, decoded)
        except CatalogUnwritable:  # the catalog logged that it cannot write, once (WriteHealth)
            pass
        except Exception:  # variants are an optimisation: never fail an answered request
            log.exception("keeping the request's variants failed")
        ids, contexts = [c.chunk_id for c in inputs], source_contexts(inputs)
        return (
            self.cache.variants.policy.should_build(result.mode, ids)
            and needs_build(self.engine, result, contexts, decoded)
            and self.builder.submit(result, contexts, decoded)
        )

    def drain(self) -> None:
        """Wait until the background work queued so far (variant builds, then promotions) is
        done (benchmarks, tests)."""
        self.builder.join()
        self.store.join_promotions()

    # -- ingest and deletion -------------------------------------------------------------------

    def put_base(self, chunk_id: ChunkId, token_ids: Sequence[int]) -> str | None:
        """Compute and store a chunk's base variant; returns the tier that took it (None: no
        tier could, and the KV will be computed on first use).

        It goes to the first persistent tier (disk, else Redis), so what ingest computed
        survives restarts and separate `kvmosaic ingest` runs; first use promotes it. A
        persistent tier that is down (Redis unreachable) or cannot write (a full disk)
        passes it to the next tier below; with none left it goes to the first tier with room
        (memory: said so in the log and in the ingest's `kv_tiers`, and copied into the
        persistent tier once it can write again, `app.kvcache.persist`).
        """
        return self.store_base(chunk_id, self.engine.encode_chunk(tuple(token_ids)))

    def put_bases(
        self,
        chunks: Sequence[tuple[int, Sequence[int]]],
        on_batch: Callable[[int, int], None] | None = None,
    ) -> list[str | None]:
        """`put_base` of many (chunk id, token ids), encoded in packed batches
        (`Engine.encode_chunks`); `on_batch(chunks, tokens)` after each batch is stored.
        Returns the tier that took each chunk, in order."""
        tiers: list[str | None] = []
        for group in batches([len(ids) for _, ids in chunks], self.batch_tokens):
            kvs = self.engine.encode_chunks([chunks[i][1] for i in group], self.batch_tokens)
            tiers += [self.store_base(chunks[i][0], kv) for i, kv in zip(group, kvs)]
            if on_batch is not None:
                on_batch(len(group), sum(kv.num_tokens for kv in kvs))
        return tiers

    def store_base(
        self, chunk_id: ChunkId, kv: ChunkKV, conditioning: Conditioning | None = None
    ) -> str | None:
        """Store a computed base variant as `put_base` does (a neighbour-conditioned base with
        its `conditioning`); the tier that took it, or None."""
        tag = conditioning.tag if conditioning is not None else ""
        stored = self.cache.variants.put(chunk_id, kv, tier=self.persistent_tier, conditioning=tag)
        if stored is None and self.persistent_tier is not None:
            stored = self.cache.variants.put(chunk_id, kv, conditioning=tag)
            if stored is not None:
                log.warning(
                    "chunk %d: no persistent tier could take its KV; it is in %s only",
                    chunk_id,
                    stored.tier,
                )
                self.unpersisted.add(stored.store_key)
        elif stored is not None and len(
            self.unpersisted
        ):  # the persistent tier writes again: the rest follow
            self.unpersisted.retry()
        if stored is None:
            log.warning(
                "chunk %d: no store tier could take its KV; it will be computed on use", chunk_id
            )
        return stored.tier if stored is not None else None

    def conditioned_key(self, token_ids: Sequence[int], conditioning: Conditioning) -> str:
        """The store key of a chunk's neighbour-conditioned base of kind `conditioning`."""
        return self.cache.variants.keys.key(token_ids, conditioning=conditioning.tag)

    def is_memory_only(self, tier: str) -> bool:
        """True if base KV in `tier` is lost at exit although a persistent tier exists."""
        return self.persistent_tier is not None and tier not in PERSISTENT_TIERS

    def forget_document(self, document_id: int) -> DeletedDocument | None:
        return self.cache.maintenance.forget_document(document_id)

    # -- admin ---------------------------------------------------------------------------------

    def tier_stats(self) -> dict[str, TierFigures]:
        """Per tier name, its figures (`TierFigures`) for /admin, /health and /metrics."""
        return {report.name: report.figures() for report in self.store.stats()}

    def evict(
        self, tier: str | None, chunk_id: int | None, policy: str | None, num_bytes: int | None
    ) -> tuple[int, int]:
        """Evict a chunk's variants everywhere, and/or free bytes in a tier by policy (demoting)."""
        if tier is not None and tier not in self.store.names:
            raise InvalidRequest(
                f"unknown tier {tier!r}; this store has {', '.join(self.store.names)}"
            )
        if policy is not None and policy not in KNOWN_POLICIES:
            raise InvalidRequest(
                f"unknown policy {policy!r}; use one of {', '.join(KNOWN_POLICIES)}"
            )
        entries = freed = 0
        if chunk_id is not None:
            removed = [
                v
                for v in self.cache.catalog.variants_of_chunk(chunk_id, status=None)
                if self.store.remove(v.store_key)
            ]
            self.cache.catalog.mark_missing([v.store_key for v in removed])
            self.cache.tree.removed(v.store_key for v in removed)
            entries, freed = len(removed), sum(v.num_bytes for v in removed)
        if tier is not None or num_bytes is not None:
            moved = self.store.evict(tier or self.store.names[0], num_bytes, policy)
            entries, freed = entries + moved[0], freed + moved[1]
        return entries, freed

    def clear(self) -> tuple[int, int]:
        """Drop every entry from every tier and mark the variants missing; (entries, bytes
        freed)."""
        before = sum(s["bytes"] for s in self.tier_stats().values())
        keys = self.store.clear()
        self.cache.catalog.mark_missing(keys)
        self.cache.tree.removed(keys)
        return len(keys), before - sum(s["bytes"] for s in self.tier_stats().values())

    def close(self) -> None:
        self.builder.close()
        self.store.close()


def open_chunk_cache(settings: Settings, catalog: Catalog, engine: Engine) -> ServiceChunkCache:
    """The store from settings, joined to the catalog; reconciled before the first request."""
    config = settings.store_config().for_model(str(engine.loaded.dtype).removeprefix("torch."))
    store = create_store(config)
    # Base KV computed on use goes where ingest puts it, so a cleared or cold cache is
    # persistent again after one use instead of living in RAM only.
    cache = ChunkKVCache.open(
        engine,
        store,
        catalog,
        storage_dtype=config.codec,
        prefetch_layers=config.prefetch_layers,
        base_tier=first_persistent_tier(store.names),
        variant_dtype=config.context_variant_codec,
    )
    try:
        cache.maintenance.reconcile(settings.kv_orphan_grace_s)
    except CatalogUnwritable as exc:  # a full volume: serve; a stale status costs one lookup
        log.error("catalog and KV store not reconciled at start-up: %s", exc)
    cache.tree.rebuild()  # the catalog as reconciled: this replica's and its peers' variants
    return ServiceChunkCache(cache, settings.ingest_batch_tokens)


def first_persistent_tier(names: Sequence[str]) -> str | None:
    """The first tier that survives a restart (disk, else Redis); None if there is none."""
    return next((n for n in names if n in PERSISTENT_TIERS), None)


def _fell_back(kv: KVSource | None) -> bool:
    """True if a stored entry's layers failed their checksum and the chunk was recomputed."""
    return isinstance(kv, LazyChunkKV) and kv.stats.fell_back


def _label(context: Sequence[ChunkId], computed: bool, conditioned: bool = False) -> str:
    if computed:
        return COMPUTED_NOW
    if conditioned:
        return CONDITIONED
    return "base" if not context else f"after {context_signature(context)}"
