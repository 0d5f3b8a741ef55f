"""`ChunkLoader`: a request's chunk KV from the tiered store, pinned and read layer by layer.

Stored KV is read lazily, layer by layer, overlapped with the compute (`LazyChunkKV`). A
wanted context variant that is not stored falls back to the base variant's exact copy where
one is kept (`VariantKeys.base_copy_codec`, under a lossy base codec), then to the chunk's
base variant; so does a wanted neighbour-conditioned base (`ChunkRef.conditioning`); a missing,
corrupt or foreign base entry is recomputed with `Engine.encode_chunk` and stored, so a chunk
served from the store and one computed now give bit-identical KV (both pass through the
storage dtype).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

from app.catalog import Catalog, CatalogUnwritable
from app.kvcache.keys import VariantKeys
from app.kvcache.variants import ChunkRef, ChunkVariants
from app.store import LazyChunkKV, LoadStats, TieredStore, chunk_from_entry, entry_from_chunk
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.kv import ChunkId, ChunkKV, KVSource
from engine.plan import ChunkInput
from engine.variant_stats import VariantStats

log = logging.getLogger(__name__)


@dataclass
class OpenedEntry:
    key: str
    tier: str
    source: LazyChunkKV


@dataclass
class LoadedChunks:
    """The request's chunk inputs; close (or leave the `with`) when the prefill is done.

    `computed` lists the chunk ids whose KV was computed now (cold or corrupt entries).
    Closing stops background reads, unpins the entries, records one access per variant
    in the catalog and promotes entries read from a lower tier. `loader` None: nothing was
    read or pinned (a mode that reuses no cache), so closing does nothing.
    """

    inputs: list[ChunkInput]
    computed: list[ChunkId]
    loader: ChunkLoader | None
    opened: list[OpenedEntry] = field(default_factory=list)
    used_keys: list[str] = field(default_factory=list)
    closed: bool = False

    def load_stats(self) -> LoadStats:
        total = LoadStats()
        for entry in self.opened:
            stats = entry.source.stats
            total.load_s += stats.load_s
            total.wait_s += stats.wait_s
            total.layers_read += stats.layers_read
            total.layers_wasted += stats.layers_wasted
            total.fell_back |= stats.fell_back
        return total

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.loader is not None:
            self.loader.release(self)

    def __enter__(self) -> LoadedChunks:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


class ChunkLoader:
    """Thread-safe; one per engine and store."""

    def __init__(
        self,
        engine: Engine,
        store: TieredStore,
        catalog: Catalog,
        variants: ChunkVariants,
        prefetch_layers: int = 2,
        base_tier: str | None = None,
    ):
        """`base_tier`: where base variants computed on use (cold or corrupt) are stored, as
        at ingest; a persistent tier keeps them across restarts. None: the first tier."""
        self.engine, self.store, self.catalog, self.variants = engine, store, catalog, variants
        self.keys: VariantKeys = variants.keys
        self.prefetch_layers = prefetch_layers
        self.base_tier = base_tier

    def load(self, chunks: Sequence[ChunkRef]) -> LoadedChunks:
        """ChunkInputs for `chunks`, in order. A wanted context variant that is not stored
        falls back to the base variant; a base variant that is not stored is computed now."""
        loaded = LoadedChunks([], [], self)
        try:
            for ref in chunks:
                if ref.compute:
                    loaded.inputs.append(ChunkInput(ref.chunk_id, tuple(ref.token_ids)))
                    continue
                source = self._source(ref, loaded)
                # statistics describe the wanted variant; a fallback to the base has none
                stats = ref.stats if tuple(source.context) == tuple(ref.context) else None
                loaded.inputs.append(ChunkInput(ref.chunk_id, tuple(ref.token_ids), source, stats))
        except BaseException:
            loaded.close()
            raise
        return loaded

    def _source(self, ref: ChunkRef, loaded: LoadedChunks) -> KVSource:
        """The wanted variant (a context variant or a conditioned base), else the base
        variant's exact copy (`VariantKeys.base_copy_codec`), else the base variant, else the
        base computed now."""
        if not ref.token_ids:
            raise InvalidRequest(f"chunk {ref.chunk_id} has no tokens")
        wanted: list[tuple[ChunkRef, str | None]] = (
            [(ref, None)] if ref.context or ref.conditioning else []
        )
        if self.keys.base_copy_codec is not None:
            wanted.append((ref.base(), self.keys.base_copy_codec))
        wanted.append((ref.base(), None))
        for candidate, codec in wanted:
            source = self._open(candidate, loaded, codec)
            if source is not None:
                return source
        loaded.computed.append(ref.chunk_id)
        loaded.used_keys.append(self.keys.key(ref.token_ids))
        return self.compute_base(ref.base())

    def _open(
        self, ref: ChunkRef, loaded: LoadedChunks, codec: str | None = None
    ) -> LazyChunkKV | None:
        key = self.keys.key(ref.token_ids, ref.context, codec, ref.conditioning)
        self.store.pin(key)  # before opening, so it cannot be evicted in between
        opened = self.store.open(
            key, self.keys.expectation(ref.token_ids, ref.context, codec, ref.conditioning)
        )
        if opened is None:
            self.store.unpin(key)
            return None
        tier = opened.tier
        source = LazyChunkKV(
            opened.reader,
            self.store.loader,
            self.engine.loaded.dtype,
            self.engine.device,
            prefetch=self.prefetch_layers,
            fallback=lambda: self.compute_base(ref.base()),
            on_corrupt=lambda reason: self.store.report_corrupt(key, tier, reason),
        )
        loaded.opened.append(OpenedEntry(key, tier, source))
        loaded.used_keys.append(key)
        return source

    def compute_base(self, ref: ChunkRef) -> ChunkKV:
        """Encode the chunk alone after the system prefix, store it, and return it as stored."""
        entry = entry_from_chunk(self.engine.encode_chunk(ref.token_ids), self.keys.storage_dtype)
        self.variants.put_entry(
            ref.chunk_id, self.keys.key(ref.token_ids), entry, VariantStats(), self.base_tier
        )
        return chunk_from_entry(entry, ref.token_ids, self.engine.loaded.dtype, self.engine.device)

    def release(self, loaded: LoadedChunks) -> None:
        """Stop the reads, unpin, promote what came from a lower tier, count the accesses."""
        for entry in loaded.opened:
            entry.source.close()
            self.store.unpin(entry.key)
            if entry.tier != self.store.names[0]:
                self.store.promote_later(entry.key)
        try:
            self.catalog.record_access(loaded.used_keys)
        except CatalogUnwritable:  # the catalog logged that it cannot write, once (WriteHealth)
            pass
        except Exception:  # statistics must not fail a request that already succeeded
            log.exception("recording variant accesses failed")
