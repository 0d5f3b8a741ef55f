"""`ChunkTreeIndex`: this replica's prefix tree of chunk sequences, kept in step with the catalog.

The catalog is the source of truth: every stored variant has a row there, whichever replica
stored it. The tree (`app.variants.tree.ChunkTree`) is a local, rebuildable view of the
ready rows of this model and system prefix, in the codec the loader reads for that context
(`VariantKeys.codec`, or a base's exact copy):

- `rebuild` reads the catalog and replaces the tree: at start-up (after reconcile) and every
  `TREE_REFRESH_S` on the replica daemon (`app/services.py`), which brings in the variants
  peers stored and drops the ones they evicted. On a shared catalog, a row counts only where
  this replica can read its KV: in a shared tier (Redis), or in one of its own tiers; a peer's
  memory or disk is out of reach (a row names one tier, the fastest when last known, so a KV
  a peer promoted out of Redis is left out until it moves again).
- Local changes apply at once: `stored` (every variant put, `ChunkVariants.put_entry`),
  `removed` (pruned variants, deleted documents, admin evictions and clears) and
  `entry_dropped` (the store evicted an entry from its last tier, or found it corrupt: this
  is a `StoreListener`).
- A change made while a rebuild reads the catalog is kept in a journal and replayed on the
  new tree, so the swap does not lose it.

A stale node (a peer's eviction not yet seen) only makes the order stage guess a path the
loader then misses; the loader and the planner check each variant's context themselves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from app.catalog import Catalog, VariantContext
from app.kvcache.keys import VariantKeys
from app.store import TieredStore
from app.variants.order import ChunkOrder, Ordering
from app.variants.tree import ChunkTree, Path
from engine.kv import ChunkId

log = logging.getLogger(__name__)

Change = tuple[str, str, Path | None]  # ("add" | "remove", store key, path)


class ChunkTreeIndex:
    """Thread-safe: one lock over the tree; rebuilds are serialised and read the catalog
    outside it."""

    def __init__(self, catalog: Catalog, keys: VariantKeys, store: TieredStore | None = None):
        """`store`: this replica's, to tell on a shared catalog which rows it can read (None:
        every row counts)."""
        self.catalog, self.keys, self.store = catalog, keys, store
        self._tree = ChunkTree()
        self._paths: dict[str, Path] = {}  # store key -> its node
        self._journal: list[Change] | None = None  # changes during a rebuild's catalog read
        self._lock = threading.Lock()
        self._rebuilding = threading.Lock()

    # -- reading -------------------------------------------------------------------------------

    def order(self, retrieved: Sequence[ChunkId], rule: ChunkOrder) -> Ordering:
        """`retrieved` in the order `rule` chooses over the tree as it stands."""
        with self._lock:
            return rule.order(self._tree, retrieved)

    def holds(self, path: Path) -> bool:
        with self._lock:
            return self._tree.holds(path)

    def __len__(self) -> int:
        with self._lock:
            return len(self._paths)

    # -- local changes -------------------------------------------------------------------------

    def stored(
        self, key: str, chunk_id: ChunkId, context: Sequence[ChunkId], storage_dtype: str
    ) -> None:
        """A variant was stored and recorded here; ignored if the loader would not read it."""
        if not self._readable(tuple(context), storage_dtype):
            return
        with self._lock:
            self._apply(self._tree, self._paths, ("add", key, ChunkTree.path_of(chunk_id, context)))

    def removed(self, keys: Iterable[str]) -> None:
        """Variants were deleted or their KV is gone (keys the tree never held are ignored)."""
        with self._lock:
            for key in keys:
                self._apply(self._tree, self._paths, ("remove", key, None))

    # StoreListener: evictions from the last tier and corrupt entries arrive here
    def entry_moved(self, key: str, tier: str) -> None:
        """A move between tiers changes nothing: the KV is still stored."""

    def entry_dropped(self, key: str) -> None:
        self.removed([key])

    # -- from the catalog ----------------------------------------------------------------------

    def rebuild(self) -> int:
        """Replace the tree by the catalog's ready variants (plus changes made meanwhile);
        returns how many variants it holds."""
        with self._rebuilding:
            with self._lock:
                self._journal = []
            try:
                rows = self.catalog.variant_contexts(
                    self.keys.engine.fingerprint, self.keys.engine.prompts.prefix_digest
                )
            except BaseException:
                with self._lock:
                    self._journal = None
                raise
            tree, paths = ChunkTree(), dict[str, Path]()
            for row in rows:
                if self._readable(row.context, row.storage_dtype) and self._reachable(row):
                    self._apply(tree, paths, _added(row))
            with self._lock:
                for change in self._journal or ():
                    self._apply(tree, paths, change)
                self._tree, self._paths, self._journal = tree, paths, None
                return len(paths)

    # -- helpers -------------------------------------------------------------------------------

    def _readable(self, context: tuple[ChunkId, ...], storage_dtype: str) -> bool:
        """Whether the loader reads a variant of `context` stored in `storage_dtype`."""
        return storage_dtype == self.keys.codec(context) or (
            not context and storage_dtype == self.keys.base_copy_codec
        )

    def _reachable(self, row: VariantContext) -> bool:
        """Whether this replica can read the row's KV: always on its own catalog; on a shared
        one, in a shared tier or in one of its own (a peer's memory or disk is out of reach)."""
        if self.store is None or not self.catalog.is_shared:
            return True
        tiers = [self.store.tier(name) for name in self.store.live_names()]
        if any(t.shared and t.name == row.tier for t in tiers):
            return True
        try:
            return any(not t.shared and t.contains(row.store_key) for t in tiers)
        except Exception:  # a tier that cannot answer now: leave the row out (no exact path)
            return False

    def _apply(self, tree: ChunkTree, paths: dict[str, Path], change: Change) -> None:
        """Apply one change to `tree` / `paths` (idempotent per key); journal it while a
        rebuild reads the catalog."""
        op, key, path = change
        if op == "add" and path is not None and key not in paths:
            paths[key] = path
            tree.add(path)
        elif op == "remove" and key in paths:
            tree.discard(paths.pop(key))
        if self._journal is not None and tree is self._tree:
            self._journal.append(change)


def _added(row: VariantContext) -> Change:
    return ("add", row.store_key, ChunkTree.path_of(row.chunk_id, row.context))
