"""Running request figures for `/admin/stats` (Prometheus has the histograms)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.queue import WorkQueue


class Counters:
    """Thread-safe: answered questions per mode and the mean share of context recomputed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_mode: Counter[str] = Counter()
        self._share_sum = 0.0

    def record(self, mode: str, recompute_share: float) -> None:
        with self._lock:
            self._by_mode[mode] += 1
            self._share_sum += recompute_share

    def mean_recompute_share(self) -> float | None:
        with self._lock:
            total = sum(self._by_mode.values())
            return round(self._share_sum / total, 4) if total else None

    def snapshot(self, queue: WorkQueue) -> dict[str, object]:
        with self._lock:
            by_mode = dict(self._by_mode)
        return {
            "answered": sum(by_mode.values()),
            "by_mode": by_mode,
            "rejected": queue.num_rejected,
            "running": queue.running,
            "waiting": queue.waiting,
            "capacity": queue.capacity,
        }
