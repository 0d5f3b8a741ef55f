"""Builds Cache-Craft variants in the background, after the answer has gone out.

A `cachecraft` request leaves new variants for its context (engine/cachecraft/variants.py),
which costs one more prefill of its prompt. That work must delay neither the first token
nor the rest of the answer, and must not pile up under load: one background thread takes
jobs from a short queue, and a request that finds the queue full leaves no variants
(counted as skipped); the cache keeps improving from the requests it can afford.
"""

from __future__ import annotations

import logging
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
