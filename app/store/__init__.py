"""The tiered KV store: chunk KV kept in GPU, CPU, disk and Redis tiers, read layer by layer.

Public API:
- `StoreConfig` — every knob (tiers in order, capacities, disk dir, Redis URL, storage
  dtype, eviction policy, loader threads).
- `create_store(config)` → `TieredStore`: `put(key, entry, tier=None)`, `get(key, expect)`,
  `open(key, expect)` (layer-wise reader), `promote` / `promote_later`, `pin` / `unpin`,
  `remove`, `where` / `contains` / `locations`, `live_names`, `set_usage` (access counts
  and expected savings for the `value` policy), `evict(tier, bytes)` / `clear()` (admin),
  `stats()` (per-tier `TierReport`s), `subscribe(listener)`, `close()`.
- `create_tier(name, config)` → a `BaseTier` (`gpu`, `cpu`, `disk`, `redis`); the contract
  and its edge cases are on `BaseTier`.
- `KVEntry` / `EntryMeta` / `EntryExpectation` — what a tier stores and what a reader
  requires; `entry_from_chunk` / `chunk_from_entry` convert to and from `engine.kv.ChunkKV`.
- `LazyChunkKV` — a `KVSource` that reads layer i + 1 in the background while layer i is
  computed.

The store knows nothing of the catalog; `app.kvcache.cache` joins the two.
"""

from app.store.base import BaseTier, EntryPinned, EntryReader, TierOccupancy, TierUnavailable
from app.store.config import StoreConfig
from app.store.entry import (
    CorruptEntry,
    EntryExpectation,
    EntryMeta,
    KVEntry,
    chunk_from_entry,
    entry_from_chunk,
    token_ids_hash,
)
from app.store.events import StoreListener
from app.store.lazy import LazyChunkKV, LoadStats
from app.store.policy import create_policy
from app.store.registry import TIERS, create_store, create_tier
from app.store.stats import TierCounters, TierFigures, TierReport
from app.store.tiered import Opened, TieredStore

__all__ = [
    "TIERS",
    "BaseTier",
    "CorruptEntry",
    "EntryExpectation",
    "EntryMeta",
    "EntryPinned",
    "EntryReader",
    "KVEntry",
    "LazyChunkKV",
    "LoadStats",
    "Opened",
    "StoreConfig",
    "StoreListener",
    "TierCounters",
    "TierFigures",
    "TierReport",
    "TierOccupancy",
    "TierUnavailable",
    "TieredStore",
    "chunk_from_entry",
    "create_policy",
    "create_store",
    "create_tier",
    "entry_from_chunk",
    "token_ids_hash",
]
