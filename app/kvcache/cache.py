"""`ChunkKVCache`: the chunk KV cache over one engine, store and catalog, split by job.

    cache = ChunkKVCache.open(engine, store, catalog)
    cache.maintenance.reconcile()                        # once at start-up
    refs = cache.variants.choose(mode, [(chunk.id, engine.chunk_ids(chunk.text))])
    with cache.loader.load(refs) as loaded:
        result = engine.prefill(loaded.inputs, question, mode)
    decoded = ...                                         # engine.generate(result), read out
    cache.variants.record_savings(result, loaded.inputs)  # what each context variant saved
    cache.variants.harvest(result, loaded.inputs, decoded)  # the exact rows it computed, kept
    cache.variants.build(result, contexts, decoded)       # Cache-Craft, in the background

- `keys` (`keys.py`): where a variant lives in the store and what a reader must find there;
- `variants` (`variants.py`): which variant a request uses, what it leaves, which are kept;
- `loader` (`loader.py`): the request's KV read from the store (pinned, lazy), missing base
  KV computed and stored;
- `maintenance` (`maintenance.py`): catalog and store kept in step (reconcile, orphan sweep,
  document deletion, the store's own moves and drops);
- `tree` (`chunk_tree.py`): the prefix tree of chunk sequences over the stored exact-context
  variants, which the order stage walks (rebuild it from the catalog after `reconcile`).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.catalog import Catalog
from app.kvcache.chunk_tree import ChunkTreeIndex
from app.kvcache.keys import VariantKeys
from app.kvcache.loader import ChunkLoader
from app.kvcache.maintenance import KVMaintenance
from app.kvcache.variants import ChunkVariants
from app.store import TieredStore
from engine.engine import Engine


@dataclass(frozen=True)
class ChunkKVCache:
    engine: Engine
    store: TieredStore
    catalog: Catalog
    keys: VariantKeys
    variants: ChunkVariants
    loader: ChunkLoader
    maintenance: KVMaintenance
    tree: ChunkTreeIndex

    @classmethod
    def open(
        cls,
        engine: Engine,
        store: TieredStore,
        catalog: Catalog,
        storage_dtype: str = "float16",
        prefetch_layers: int = 2,
        base_tier: str | None = None,
        variant_dtype: str | None = None,
    ) -> ChunkKVCache:
        """The four parts over one engine, store and catalog. `storage_dtype`: the codec of
        base variants; `variant_dtype`: of context variants (None: the same); `base_tier`:
        where base variants computed on use are stored (None: the first tier); see `ChunkLoader`."""
        keys = VariantKeys(engine, storage_dtype, variant_dtype)
        tree = ChunkTreeIndex(catalog, keys, store)
        store.subscribe(tree)  # evictions and corrupt entries leave the tree at once
        variants = ChunkVariants(engine, store, catalog, keys, tree)
        loader = ChunkLoader(engine, store, catalog, variants, prefetch_layers, base_tier)
        maintenance = KVMaintenance(store, catalog, tree)
        return cls(engine, store, catalog, keys, variants, loader, maintenance, tree)
