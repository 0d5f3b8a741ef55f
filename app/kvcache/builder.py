"""Builds Cache-Craft variants in the background, on idle capacity only.

A request whose chunk set recurs (`VariantPolicy.should_build`) and that left some chunk
inexact (`needs_build`) has exact variants built for its context (app/variants/build.py),
which costs one more prefill of its prompt from the first inexact chunk on. That work must
delay neither the first token nor the rest of any answer, and must not pile up under load: one
background thread takes jobs from a short queue and starts a job only while no request runs or
waits (`wait_idle`: it sleeps until the last request finishes rather than polling, since a
polling thread takes the interpreter lock from the compute thread many times a second); a
request that finds the queue full leaves no build (counted as skipped). The thread also runs
at a lower CPU priority (nice + 10, inherited by the threads torch starts from it), so a
request arriving during a build gets the CPU first. A build runs on one CPU thread, unless the
engine's prefill gives other bits on one thread than on its own count
(engine/serving/thread_bits.py): then each build runs on a passing thread with that count, whose
OpenMP pool ends with the build, so that a built variant is still full prefill's bit for bit.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence

from app.catalog import CatalogUnwritable
from app.kvcache.variants import ChunkVariants
from engine.decoding import Decoded
from engine.kv import ChunkId
from engine.model.work import mark_background_thread
from engine.result import PrefillResult
from engine.serving.threads import in_own_thread, single_threaded

log = logging.getLogger(__name__)

# a prefill, its chunks' source contexts and its decode's record
Job = tuple[PrefillResult, tuple[tuple[ChunkId, ...] | None, ...], Decoded]
STOP_CHECK_S = 0.2  # how soon a thread waiting for idle notices `close`


class VariantBuilder:
    def __init__(
        self,
        variants: ChunkVariants,
        max_pending: int = 2,
        wait_idle: Callable[[float], bool] | None = None,
        build_threads: int = 1,
    ):
        """`wait_idle(timeout)`: block until no request runs or waits, at most `timeout`
        seconds, True if so (`WorkQueue.wait_idle`); set by whoever runs requests (`Services`);
        None: always idle (tests, benchmarks). `build_threads`: the CPU threads a build runs
        on (`Engine.build_threads`)."""
        self.variants = variants
        self.wait_idle = wait_idle
        self.build_threads = build_threads
        self._jobs: queue.Queue[Job | None] = queue.Queue(
            maxsize=max_pending
        )  # None: stop the thread
        self._stopping = threading.Event()
        self.built = self.skipped = self.failed = 0
        self._thread = threading.Thread(target=self._work, name="variant-builder", daemon=True)
        self._thread.start()

    def submit(
        self,
        result: PrefillResult,
        contexts: Sequence[tuple[ChunkId, ...] | None],
        decoded: Decoded,
    ) -> bool:
        """Queue a finished request's prefill result, the contexts of the KV its chunks started
        from and its decode's record; False (skipped) when the queue is full."""
        try:
            self._jobs.put_nowait((result, tuple(contexts), decoded))
            return True
        except queue.Full:
            self.skipped += 1
            return False

    def join(self) -> None:
        """Wait until every queued job is done (tests, orderly shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        """Finish the queued jobs (without waiting for idle), then stop the thread."""
        self._stopping.set()
        self._jobs.put(None)
        self._thread.join()

    def _work(self) -> None:
        _lower_priority()
        # Its builds run here, beside the engine's compute thread, at low priority: on one
        # thread, so that it forms no OpenMP pool to slow that thread (engine/serving/threads.py).
        single_threaded()
        mark_background_thread()  # benchmarks tell this work from the requests' own
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._wait_for_idle()
                self.built += self._build(job)
            except CatalogUnwritable:  # logged by the catalog once, when it became unwritable
                self.failed += 1
            except Exception:  # a failed build loses variants, never the server
                self.failed += 1
                log.exception("building Cache-Craft variants failed")
            finally:
                self._jobs.task_done()

    def _build(self, job: Job) -> int:
        if self.build_threads == 1:
            return self.variants.build(*job)

        def on_passing_thread() -> int:
            mark_background_thread()
            return self.variants.build(*job)

        return in_own_thread(on_passing_thread, threads=self.build_threads)

    def _wait_for_idle(self) -> None:
        while (
            self.wait_idle is not None
            and not self._stopping.is_set()
            and not self.wait_idle(STOP_CHECK_S)
        ):
            pass


def _lower_priority(increment: int = 10) -> None:
    """Raise this thread's nice value (Linux: per thread); elsewhere do nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        )
    except (AttributeError, OSError):
        log.debug("could not lower the variant builder's priority")
