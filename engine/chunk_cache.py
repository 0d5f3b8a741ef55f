"""`ChunkKVCache`: chunk KV for a request, from the tiered store or computed and stored.

It joins the engine (computes a chunk's base variant), the store (keeps the KV) and the
catalog (records which variants exist, where, and how often they are used):

    cache = ChunkKVCache(engine, store, catalog)
    cache.reconcile()                                   # once at start-up
    with cache.load([ChunkRef(chunk.id, engine.chunk_ids(chunk.text))]) as loaded:
        result = engine.prefill(loaded.inputs, question, mode="cacheblend")
    cache.put_variant(chunk_id, kv_in_new_context, stats)   # Cache-Craft, later

Stored KV is read lazily, layer by layer, overlapped with the compute (`LazyChunkKV`).
A missing, corrupt or foreign entry is recomputed with `Engine.encode_chunk`; so a chunk
served from the store and one computed now give bit-identical KV, both pass through the
storage dtype. Writes go KV first, catalog row second: a crash in between leaves KV
without a row, which `reconcile()` removes — never a row pointing at half-written KV.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.catalog import (
    MISSING,
    READY,
    Catalog,
    CatalogError,
    NewVariant,
    VariantRecord,
    VariantStats,
    context_signature,
)
from engine.cachecraft.choice import Candidate, choose_variant
from engine.cachecraft.variants import drafts_from_request
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.kv import ChunkKV, KVSource
from engine.planners.base import ChunkInput
from engine.store import (
    EntryExpectation,
    LazyChunkKV,
    LoadStats,
    TieredStore,
    chunk_from_entry,
    entry_from_chunk,
    token_ids_hash,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkRef:
    """A chunk of a request: its catalog id, its token ids, and the variant context wanted
    (ordered ids of the chunks it was computed after; empty = the base variant)."""

    chunk_id: int
    token_ids: tuple[int, ...]
    context: tuple[str, ...] = ()
    stats: object | None = None  # Cache-Craft statistics of that variant, when measured


@dataclass(frozen=True)
class ReconcileReport:
    marked_missing: int
    marked_ready: int
    orphans_removed: int


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
                 storage_dtype: str = "float16", prefetch_layers: int = 2):
        self.engine, self.store, self.catalog = engine, store, catalog
        self.storage_dtype = storage_dtype
        self.prefetch_layers = prefetch_layers
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
        self._store(ref.chunk_id, self.key(ref.token_ids), entry, VariantStats())
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

    def choose_variants(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> list[ChunkRef]:
        """Cache-Craft: per chunk (chunk id, token ids), in request order, the stored variant of
        lowest CFO for the chunks before it; the base variant when nothing better is known."""
        config = self.engine.config
        order = [str(chunk_id) for chunk_id, _ in chunks]
        refs = []
        for i, (chunk_id, token_ids) in enumerate(chunks):
            records = self._usable_variants(chunk_id, len(token_ids))
            if not records:
                refs.append(ChunkRef(chunk_id, tuple(token_ids)))
                continue
            candidates = [Candidate(r.context, _measured(r.stats)) for r in records]
            index, _ = choose_variant(candidates, order[:i], config.craft_alpha, config.craft_novelty)
            chosen = records[index]
            refs.append(ChunkRef(chunk_id, tuple(token_ids), chosen.context, _measured(chosen.stats)))
        return refs

    def _usable_variants(self, chunk_id: int, num_tokens: int) -> list[VariantRecord]:
        return [v for v in self.catalog.variants_of_chunk(chunk_id, self.engine.fingerprint)
                if v.prefix_digest == self.engine.prompts.prefix_digest
                and v.storage_dtype == self.storage_dtype and v.num_tokens == num_tokens]

    def put_context_variants(self, result) -> int:
        """Store the variants a finished request produced (see engine/cachecraft/variants.py),
        keeping at most `craft_max_variants` per chunk; returns how many were stored."""
        stored = 0
        for draft in drafts_from_request(self.engine, result):
            stored += self.put_variant(int(draft.chunk_id), draft.kv, draft.stats) is not None
            self._prune_variants(int(draft.chunk_id))
        return stored

    def _prune_variants(self, chunk_id: int) -> None:
        """Drop the least valuable context variants beyond the limit (never the base variant).

        Value = expected savings × (accesses + 1) / bytes. The catalog row goes first, so no
        request picks a variant whose KV is being removed.
        """
        records = self.catalog.variants_of_chunk(chunk_id, self.engine.fingerprint)
        excess = len(records) - self.engine.config.craft_max_variants
        if excess <= 0:
            return
        value = lambda r: (r.stats.expected_savings or 0.0) * (r.access_count + 1) / max(1, r.num_bytes)  # noqa: E731
        doomed = sorted((r for r in records if r.context), key=value)[:excess]
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

    def reconcile(self) -> ReconcileReport:
        """Make the catalog and the store agree (call at start-up, before serving).

        Ready variants whose KV no reachable tier holds are marked missing (unless recorded
        in a tier that is unreachable now); variants whose KV is found
        are marked ready in the fastest tier holding it; KV with no catalog row is removed.
        Replicas that share Redis must share the catalog too (PostgreSQL), or they would
        remove each other's entries here.
        """
        present = self.store.locations()
        down = set(self.store.names) - set(self.store.live_names())
        rows = self.catalog.variant_locations()
        # KV recorded in a tier that is unreachable now may well still be there: keep it.
        lost = [k for k, row in rows.items() if row.status == READY and k not in present and row.tier not in down]
        found = {k: present[k] for k, row in rows.items()
                 if k in present and (row.status == MISSING or row.tier != present[k])}
        orphans = [k for k in present if k not in rows]
        for key in orphans:
            self.store.remove(key)
        for key, row in rows.items():
            if key in present:
                self.store.set_usage(key, access_count=row.access_count, savings=row.expected_savings)
        report = ReconcileReport(self.catalog.mark_missing(lost), self.catalog.mark_ready(found), len(orphans))
        log.info("catalog reconciled with the store: %s", report)
        return report

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


def _measured(stats: VariantStats) -> VariantStats | None:
    """The statistics if they were ever measured (a base variant from ingest has none)."""
    return stats if stats is not None and stats.cci is not None else None
