"""Builds Cache-Craft variants in the background, after the answer has gone out.

A `cachecraft` request leaves new variants for its context (engine/cachecraft/variants.py),
which costs one more prefill of its prompt. That work must delay neither the first token
nor the rest of the answer, and must not pile up under load: one background thread takes
jobs from a short queue, and a request that finds the queue full leaves no variants
(counted as skipped); the cache keeps improving from the requests it can afford. The
thread runs at a lower CPU priority (nice + 10, inherited by the threads torch starts from
it), so on a busy machine the requests' own work goes first.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

log = logging.getLogger(__name__)

_STOP = object()


class VariantBuilder:
    def __init__(self, chunk_cache, max_pending: int = 2):
        self.chunk_cache = chunk_cache  # engine.chunk_cache.ChunkKVCache
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self.built = self.skipped = self.failed = 0
        self._thread = threading.Thread(target=self._work, name="variant-builder", daemon=True)
        self._thread.start()

    def submit(self, result) -> bool:
        """Queue a finished request's prefill result; False (skipped) when the queue is full."""
        try:
            self._jobs.put_nowait(result)
            return True
        except queue.Full:
            self.skipped += 1
            return False

    def join(self) -> None:
        """Wait until every queued job is done (tests, orderly shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._jobs.put(_STOP)
        self._thread.join()

    def _work(self) -> None:
        _lower_priority()
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                self.built += self.chunk_cache.put_context_variants(job)
            except Exception:  # a failed build loses variants, never the server
                self.failed += 1
                log.exception("building Cache-Craft variants failed")
            finally:
                self._jobs.task_done()


def _lower_priority(increment: int = 10) -> None:
    """Raise this thread's nice value (Linux: per thread); elsewhere do nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except (AttributeError, OSError):
        log.debug("could not lower the variant builder's priority")
