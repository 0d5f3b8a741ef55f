"""Store events for listeners (the chunk cache keeps the catalog in step with them).

Events are queued while the store holds its lock and delivered afterwards, in order, so a
listener (a database write) never runs under the store lock and never sees events out of
order. A failing listener is logged; it cannot break the store.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger(__name__)


class StoreListener(Protocol):
    def entry_moved(self, key: str, tier: str) -> None:
        """The fastest tier holding `key` is now `tier` (after a demotion or promotion)."""

    def entry_dropped(self, key: str) -> None:
        """No tier holds `key` any more."""


class EventQueue:
    def __init__(self) -> None:
        self._events: list[tuple[str, str | None]] = []
        self._listeners: list[StoreListener] = []
        self._lock = threading.Lock()
        self._deliver_lock = threading.Lock()

    def subscribe(self, listener: StoreListener) -> None:
        self._listeners.append(listener)

    def located(self, key: str, tier: str | None) -> None:
        """Queue where `key` is now: moved to `tier`, or dropped if None."""
        with self._lock:
            self._events.append((key, tier))

    def deliver(self) -> None:
        with self._deliver_lock:
            with self._lock:
                events, self._events = self._events, []
            for key, tier in events:
                for listener in self._listeners:
                    try:
                        if tier is not None:
                            listener.entry_moved(key, tier)
                        else:
                            listener.entry_dropped(key)
                    except Exception:  # a listener bug must not break the store
                        log.exception("store listener failed on %s -> %s", key, tier)
