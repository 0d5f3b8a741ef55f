"""Make the catalog and the KV store agree, without undoing a peer replica's live work.

`Reconciler.reconcile` runs at start-up; `sweep_orphans` runs again on an interval (the app's
replica daemon). The rules, and why:

- A READY variant whose KV no reachable tier holds is marked missing, unless its tier is
  unreachable now (the KV may well still be there) or the catalog is shared (PostgreSQL)
  and its tier is not: KV in a peer's memory or disk is invisible here but not lost. A
  variant marked READY wrongly costs one lookup and a recompute; marked missing wrongly, it
  costs every replica its reuse.
- KV found for a variant is marked READY in the fastest tier holding it.
- KV with no catalog row (an orphan: writes go KV first, catalog row second, so a crash in
  between, or a peer between its two steps, leaves one) is removed only once it has been
  seen orphaned for `grace_s` seconds and still has no row when it is removed. A grace of
  0 removes at once (single process, nothing else writes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass

from app.catalog import MISSING, READY, Catalog
from app.store import TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileReport:
    marked_missing: int
    marked_ready: int
    orphans_removed: int


class Reconciler:
    """Thread-safe. Remembers since when each orphan has been seen, between calls."""

    def __init__(self, store: TieredStore, catalog: Catalog):
        self.store, self.catalog = store, catalog
        self._orphans_since: dict[str, float] = {}
        self._lock = threading.Lock()

    def reconcile(self, grace_s: float = 0.0) -> ReconcileReport:
        """The start-up pass: statuses and tiers of variants, then the orphan sweep."""
        present = self.store.locations()  # store first: a row committed after it is seen below
        rows = self.catalog.variant_locations()
        lost = [
            k
            for k, row in rows.items()
            if row.status == READY and k not in present and self._judges(row.tier)
        ]
        found = {
            k: present[k]
            for k, row in rows.items()
            if k in present and (row.status == MISSING or row.tier != present[k])
        }
        for key, row in rows.items():
            if key in present:
                self.store.set_usage(
                    key, access_count=row.access_count, savings=row.expected_savings
                )
        removed = self._sweep(present, rows.keys(), grace_s)
        report = ReconcileReport(
            self.catalog.mark_missing(lost), self.catalog.mark_ready(found), removed
        )
        log.info("catalog reconciled with the store: %s", report)
        return report

    def sweep_orphans(self, grace_s: float) -> int:
        """Remove KV that has had no catalog row for at least `grace_s`; returns how many."""
        present = self.store.locations()
        return self._sweep(present, self.catalog.variant_statuses().keys(), grace_s)

    def _judges(self, tier: str) -> bool:
        """May this replica conclude that a variant recorded in `tier` is gone?"""
        if tier not in self.store.names:  # a tier this replica lacks: a peer's, or configured away
            return not self.catalog.is_shared
        if tier not in self.store.live_names():  # down now: the KV may well still be there
            return False
        return not self.catalog.is_shared or self.store.tier(tier).shared

    def _sweep(self, present: dict[str, str], known: Collection[str], grace_s: float) -> int:
        now = time.monotonic()
        with self._lock:
            orphans = {k for k in present if k not in known}
            self._orphans_since = {k: self._orphans_since.get(k, now) for k in orphans}
            due = [k for k, since in self._orphans_since.items() if now - since >= grace_s]
            for key in due:
                del self._orphans_since[key]
        removed = 0
        for key in due:
            if self.catalog.get_variant(key) is None:  # a row may have arrived since the listing
                removed += bool(self.store.remove(key))
        if removed:
            log.info(
                "removed %d KV entries that no catalog row claimed for %.0f s", removed, grace_s
            )
        return removed
