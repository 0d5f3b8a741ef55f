"""Keeping the catalog and the store in step: start-up reconcile, orphan sweeps, document
deletion, and the store's moves and drops mirrored into the catalog."""

from __future__ import annotations

from app.catalog import Catalog, DeletedDocument
from app.kvcache.chunk_tree import ChunkTreeIndex
from app.kvcache.reconcile import Reconciler, ReconcileReport
from app.store import TieredStore


class KVMaintenance:
    """Thread-safe. Subscribes to the store on construction (a `StoreListener`)."""

    def __init__(self, store: TieredStore, catalog: Catalog, tree: ChunkTreeIndex | None = None):
        """`tree`: the prefix tree of chunk sequences, told of the variants a deletion removes."""
        self.store, self.catalog, self.tree = store, catalog, tree
        self.reconciler = Reconciler(store, catalog)
        store.subscribe(self)

    def reconcile(self, orphan_grace_s: float = 0.0) -> ReconcileReport:
        """Make the catalog and the store agree (call at start-up, before serving): see
        `app/kvcache/reconcile.py` for the rules that keep it safe next to live peers."""
        return self.reconciler.reconcile(orphan_grace_s)

    def sweep_orphans(self, grace_s: float) -> int:
        """Remove KV no catalog row has claimed for `grace_s` seconds (call periodically)."""
        return self.reconciler.sweep_orphans(grace_s)

    def forget_document(self, document_id: int) -> DeletedDocument | None:
        """Delete a document from the catalog, then its variants' KV from the store; None if
        there was no such document."""
        deleted = self.catalog.delete_document(document_id)
        if deleted is not None and self.tree is not None:
            self.tree.removed(deleted.store_keys)
        for key in deleted.store_keys if deleted else ():
            self.store.remove(key)
        return deleted

    # -- StoreListener: the store moved or dropped an entry on its own (promotion, eviction)

    def entry_moved(self, key: str, tier: str) -> None:
        self.catalog.set_variant_tier(key, tier)

    def entry_dropped(self, key: str) -> None:
        self.catalog.mark_missing([key])
