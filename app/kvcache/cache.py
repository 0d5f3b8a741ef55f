"""`ChunkKVCache`: chunk KV for a request, from the tiered store or computed and stored.

It joins the engine (computes a chunk's base variant), the store (keeps the KV) and the
catalog (records which variants exist, where, and how often they are used):

    cache = ChunkKVCache(engine, store, catalog)
    cache.reconcile()                                   # once at start-up
    refs = cache.choose_variants(mode, [(chunk.id, engine.chunk_ids(chunk.text))])
    with cache.load(refs) as loaded:
        result = engine.prefill(loaded.inputs, question, mode=mode)
    cache.record_savings(result, loaded.inputs)         # what each context variant saved
    cache.harvest_variants(result, loaded.inputs)       # the exact rows it computed, kept
    cache.build_variants(result, contexts)              # Cache-Craft, in the background

Which variant a mode uses and what its requests leave is `VariantPolicy`'s call
(`engine/variants/policy.py`), the same one the benchmarks use.

Stored KV is read lazily, layer by layer, overlapped with the compute (`LazyChunkKV`).
A missing, corrupt or foreign entry is recomputed with `Engine.encode_chunk`; so a chunk
served from the store and one computed now give bit-identical KV, both pass through the
storage dtype. Writes go KV first, catalog row second: a crash in between leaves KV
without a row, which the orphan sweep (`reconcile`, `sweep_orphans`) removes after a grace
period — never a row pointing at half-written KV.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from app.catalog import (
    Catalog,
    CatalogError,
    NewVariant,
    VariantRecord,
    VariantStats,
    context_signature,
)
from engine.cachecraft.choice import Candidate
from engine.variants.build import build_variants
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.kv import ChunkKV, KVSource
from engine.plan import ChunkInput
from app.kvcache.reconcile import ReconcileReport, Reconciler
from app.store import (
    EntryExpectation,
    LazyChunkKV,
    LoadStats,
    TieredStore,
    chunk_from_entry,
    entry_from_chunk,
    token_ids_hash,
)
from engine.variants.harvest import harvest, source_contexts
from engine.variants.policy import VariantPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkRef:
    """A chunk of a request: its catalog id, its token ids, and the variant context wanted
    (ordered ids of the chunks it was computed after; empty = the base variant)."""

    chunk_id: int
    token_ids: tuple[int, ...]
    context: tuple[str, ...] = ()
    stats: object | None = None  # Cache-Craft statistics of that variant, when measured
    compute: bool = False  # load no KV: the request computes this chunk (an inline build)


@dataclass
class LoadedChunks:
    """The request's chunk inputs; close (or leave the `with`) when the prefill is done.

    `computed` lists the chunk ids whose KV was computed now (cold or corrupt entries).
    Closing stops background reads, unpins the entries, records one access per variant
    in the catalog and promotes entries read from a lower tier.
    """

    inputs: list[ChunkInput]
    computed: list[int]
    _cache: ChunkKVCache
    _opened: list[tuple[str, str, LazyChunkKV]] = field(default_factory=list)  # key, tier, source
    _used_keys: list[str] = field(default_factory=list)
    _closed: bool = False

    def load_stats(self) -> LoadStats:
        total = LoadStats()
        for _, _, source in self._opened:
            total.load_s += source.stats.load_s
            total.wait_s += source.stats.wait_s
            total.layers_read += source.stats.layers_read
            total.layers_wasted += source.stats.layers_wasted
            total.fell_back |= source.stats.fell_back
        return total

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cache._release(self)

    def __enter__(self) -> LoadedChunks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ChunkKVCache:
    """Thread-safe; one per engine. Subscribes to the store to keep the catalog in step."""

    def __init__(self, engine: Engine, store: TieredStore, catalog: Catalog,
                 storage_dtype: str = "float16", prefetch_layers: int = 2, base_tier: str | None = None):
        """`base_tier`: where base variants computed on use (cold or corrupt) are stored, as
        at ingest; a persistent tier keeps them across restarts. None: the first tier."""
        self.engine, self.store, self.catalog = engine, store, catalog
        self.storage_dtype = storage_dtype
        self.prefetch_layers = prefetch_layers
        self.base_tier = base_tier
        self.policy = VariantPolicy(engine.config, engine.loaded.spec.num_layers)
        self.reconciler = Reconciler(store, catalog)
        store.subscribe(self)

    # -- keys ----------------------------------------------------------------------------------

    def key(self, token_ids: Sequence[int], context: Sequence[str] = ()) -> str:
        """Cache key: hash of model fingerprint, prefix digest, dtype, token ids and context."""
        h = hashlib.sha256()
        for part in (self.engine.fingerprint, self.engine.prompts.prefix_digest, self.storage_dtype,
                     context_signature(context)):
            h.update(part.encode())
            h.update(b"\0")
        h.update(np.asarray(token_ids, dtype="<i8").tobytes())
        return h.hexdigest()[:32]

    def _expectation(self, ref: ChunkRef) -> EntryExpectation:
        return EntryExpectation(self.engine.fingerprint, self.engine.prompts.prefix_digest,
                                token_ids_hash(ref.token_ids), self.storage_dtype, tuple(ref.context))

    # -- requests ------------------------------------------------------------------------------

    def load(self, chunks: Sequence[ChunkRef]) -> LoadedChunks:
        """ChunkInputs for `chunks`, in order. A wanted context variant that is not stored
        falls back to the base variant; a base variant that is not stored is computed now."""
        loaded = LoadedChunks([], [], self)
        try:
            for ref in chunks:
                if ref.compute:
                    loaded.inputs.append(ChunkInput(str(ref.chunk_id), tuple(ref.token_ids)))
                    continue
                source = self._source(ref, loaded)
                # statistics describe the wanted variant; a fallback to the base has none
                stats = ref.stats if tuple(source.context) == tuple(ref.context) else None
                loaded.inputs.append(ChunkInput(str(ref.chunk_id), tuple(ref.token_ids), source, stats))
        except BaseException:
            loaded.close()
            raise
        return loaded

    def _source(self, ref: ChunkRef, loaded: LoadedChunks) -> KVSource:
        if not ref.token_ids:
            raise InvalidRequest(f"chunk {ref.chunk_id} has no tokens")
        wanted = [ref] if not ref.context else [ref, ChunkRef(ref.chunk_id, ref.token_ids)]
        for candidate in wanted:
            source = self._open(candidate, loaded)
            if source is not None:
                return source
        loaded.computed.append(ref.chunk_id)
        base = ChunkRef(ref.chunk_id, tuple(ref.token_ids))
        loaded._used_keys.append(self.key(base.token_ids))
        return self._compute_base(base)

    def _open(self, ref: ChunkRef, loaded: LoadedChunks) -> LazyChunkKV | None:
        key = self.key(ref.token_ids, ref.context)
        self.store.pin(key)  # before opening, so it cannot be evicted in between
        opened = self.store.open(key, self._expectation(ref))
        if opened is None:
            self.store.unpin(key)
            return None
        base = ChunkRef(ref.chunk_id, tuple(ref.token_ids))
        source = LazyChunkKV(opened.reader, self.store.loader, self.engine.loaded.dtype, self.engine.device,
                             prefetch=self.prefetch_layers, fallback=lambda: self._compute_base(base),
                             on_corrupt=lambda reason: self.store.report_corrupt(key, opened.tier, reason))
        loaded._opened.append((key, opened.tier, source))
        loaded._used_keys.append(key)
        return source

    def _compute_base(self, ref: ChunkRef) -> ChunkKV:
        """Encode the chunk alone after the system prefix, store it, and return it as stored."""
        entry = entry_from_chunk(self.engine.encode_chunk(ref.token_ids), self.storage_dtype)
        self._store(ref.chunk_id, self.key(ref.token_ids), entry, VariantStats(), self.base_tier)
        return chunk_from_entry(entry, ref.token_ids, self.engine.loaded.dtype, self.engine.device)

    def _release(self, loaded: LoadedChunks) -> None:
        for key, tier, source in loaded._opened:
            source.close()
            self.store.unpin(key)
            if tier != self.store.names[0]:
                self.store.promote_later(key)
        try:
            self.catalog.record_access(loaded._used_keys)
        except Exception:  # statistics must not fail a request that already succeeded
            log.exception("recording variant accesses failed")

    # -- variants ------------------------------------------------------------------------------

    def choose_variants(self, mode: str, chunks: Sequence[tuple[int, Sequence[int]]]) -> list[ChunkRef]:
        """Per chunk (chunk id, token ids), in request order, the stored variant `mode` uses
        (`VariantPolicy.choose`); the base variant when the mode uses no other or none fits."""
        order = [str(chunk_id) for chunk_id, _ in chunks]
        if not self.policy.uses_variants(mode):
            self.policy.traffic.observe(order)
            return [ChunkRef(chunk_id, tuple(token_ids)) for chunk_id, token_ids in chunks]
        records = [self._usable_variants(chunk_id, len(token_ids)) for chunk_id, token_ids in chunks]
        chosen = self.policy.choose(mode, order, [[_candidate(r) for r in rs] for rs in records])
        refs = []
        for (chunk_id, token_ids), rs, index in zip(chunks, records, chosen):
            if index is None:
                refs.append(ChunkRef(chunk_id, tuple(token_ids)))
            else:
                refs.append(ChunkRef(chunk_id, tuple(token_ids), rs[index].context, _measured(rs[index].stats)))
        start = self.policy.compute_from(mode, order, [ref.context for ref in refs])
        if start is not None:  # an inline build: computed exactly here, harvested after
            refs[start:] = [ChunkRef(ref.chunk_id, ref.token_ids, compute=True) for ref in refs[start:]]
        return refs

    def _usable_variants(self, chunk_id: int, num_tokens: int) -> list[VariantRecord]:
        return [v for v in self.catalog.variants_of_chunk(chunk_id, self.engine.fingerprint)
                if v.prefix_digest == self.engine.prompts.prefix_digest
                and v.storage_dtype == self.storage_dtype and v.num_tokens == num_tokens]

    def record_savings(self, result, inputs: Sequence[ChunkInput]) -> None:
        """Fold what each context variant of a finished request saved into its running mean
        (catalog `expected_savings`, the store's eviction value). Call after the loaded
        chunks are closed, so their access counts include this use."""
        for report, chunk in zip(result.chunks, inputs):
            context = tuple(getattr(chunk.kv, "context", ()) or ())
            if chunk.kv is None or not context:
                continue
            key = self.key(chunk.token_ids, context)
            record = self.catalog.get_variant(key)
            if record is None:
                continue
            saved = self.policy.saved(report.tokens, report.compute_share)
            mean = self.policy.updated_savings(record.stats.expected_savings, record.access_count - 1, saved)
            self.catalog.update_variant_stats(key, VariantStats(expected_savings=mean))
            self.store.set_usage(key, savings=mean)

    def harvest_variants(self, result, inputs: Sequence[ChunkInput]) -> int:
        """Keep the chunk rows the request computed exactly in its context (no compute); returns
        how many variants were stored. Only for modes whose requests leave variants."""
        if not self.policy.harvests(result.mode):
            return 0
        stored = 0
        for chunk_id, kv in harvest(self.engine, result, source_contexts(inputs)):
            stats = VariantStats(expected_savings=self.policy.prior_savings(kv.num_tokens))
            stored += self.put_variant(int(chunk_id), kv, stats) is not None
            self._prune_variants(int(chunk_id))
        return stored

    def build_variants(self, result, contexts: Sequence[tuple[str, ...] | None]) -> int:
        """Build and store the exact, measured variants of the request's inexact chunks
        (engine/variants/build.py); returns how many were stored. Whether a request is
        worth it is the caller's question (`VariantPolicy.should_build`)."""
        stored = 0
        for draft in build_variants(self.engine, result, contexts, self.policy).drafts:
            stored += self.put_variant(int(draft.chunk_id), draft.kv, draft.stats) is not None
            self._prune_variants(int(draft.chunk_id))
        return stored

    def _prune_variants(self, chunk_id: int) -> None:
        """Drop the least valuable context variants beyond the limit (`VariantPolicy.keep`; never
        the base variant). The catalog row goes first, so no request picks a variant whose KV
        is being removed."""
        records = self.catalog.variants_of_chunk(chunk_id, self.engine.fingerprint)
        kept = set(self.policy.keep([_candidate(r) for r in records]))
        doomed = [r for i, r in enumerate(records) if i not in kept]
        if not doomed:
            return
        self.catalog.delete_variants([r.store_key for r in doomed])
        for record in doomed:
            self.store.remove(record.store_key)

    def put_variant(self, chunk_id: int, kv: ChunkKV, stats: VariantStats | None = None,
                    tier: str | None = None) -> VariantRecord | None:
        """Store KV of chunk `chunk_id` computed under `kv.context` (ordered ids of the chunks
        before it) with its statistics; KV first, then the catalog row. None if no tier could
        take it (nothing is recorded then). `tier`: start there instead of the first tier (the
        service puts ingested base variants in a persistent tier so they survive a restart)."""
        if kv.fingerprint != self.engine.fingerprint or kv.prefix_digest != self.engine.prompts.prefix_digest:
            raise InvalidRequest("this KV belongs to another model or system prefix")
        entry = entry_from_chunk(kv, self.storage_dtype)
        return self._store(chunk_id, self.key(kv.token_ids, kv.context), entry, stats or VariantStats(), tier)

    def _store(self, chunk_id: int, key: str, entry, stats: VariantStats, tier: str | None = None) -> VariantRecord | None:
        tier = self.store.put(key, entry, tier)
        if tier is None:
            log.warning("no store tier could take the KV of chunk %s", chunk_id)
            return None
        if stats.expected_savings is not None:
            self.store.set_usage(key, savings=stats.expected_savings)
        meta = entry.meta
        new = NewVariant(int(chunk_id), meta.context, meta.fingerprint, meta.prefix_digest, meta.dtype,
                         key, tier, entry.num_bytes, meta.num_tokens, stats)
        try:
            return self.catalog.put_variant(new)
        except CatalogError as exc:  # the chunk was deleted meanwhile: its KV is an orphan
            log.warning("not recording the KV of chunk %s: %s", chunk_id, exc)
            self.store.remove(key)
            return None

    # -- maintenance ---------------------------------------------------------------------------

    def reconcile(self, orphan_grace_s: float = 0.0) -> ReconcileReport:
        """Make the catalog and the store agree (call at start-up, before serving): see
        `app/kvcache/reconcile.py` for the rules that keep it safe next to live peers."""
        return self.reconciler.reconcile(orphan_grace_s)

    def sweep_orphans(self, grace_s: float) -> int:
        """Remove KV no catalog row has claimed for `grace_s` seconds (call periodically)."""
        return self.reconciler.sweep_orphans(grace_s)

    def forget_document(self, document_id: int):
        """Delete a document from the catalog, then its variants' KV from the store."""
        deleted = self.catalog.delete_document(document_id)
        for key in deleted.store_keys if deleted else ():
            self.store.remove(key)
        return deleted

    # -- store listener ------------------------------------------------------------------------

    def entry_moved(self, key: str, tier: str) -> None:
        self.catalog.set_variant_tier(key, tier)

    def entry_dropped(self, key: str) -> None:
        self.catalog.mark_missing([key])


def _candidate(record: VariantRecord) -> Candidate:
    return Candidate(record.context, _measured(record.stats), record.access_count,
                     record.stats.expected_savings, record.num_bytes)


def _measured(stats: VariantStats) -> VariantStats | None:
    """The statistics if they were ever measured (a base variant from ingest has none)."""
    return stats if stats is not None and stats.cci is not None else None
