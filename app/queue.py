"""A bounded work queue that runs engine work off the event loop.

`workers` threads run jobs; at most `queue_size` more jobs wait. A job submitted beyond that
is refused at once with `QueueFull` (the API turns it into 503 + Retry-After) rather than
waiting without bound: an overloaded server answers quickly instead of hanging.

A job submitted with a cancel flag (`submit_cancellable`) whose flag is set by the time a
worker picks it up is dropped unrun (`Abandoned`): a client that gave up while its request
waited costs no compute. The job itself checks the same flag as it goes (`raise_if_abandoned`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar, TypeVarTuple

T = TypeVar("T")
Args = TypeVarTuple("Args")


class QueueFull(Exception):
    """Every worker is busy and the waiting line is full; retry after `retry_after_s`."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the server is busy; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class Abandoned(Exception):
    """The job's cancel flag was set before it started (or before a stage it checks): its
    client went away, so the work was dropped."""


def raise_if_abandoned(cancel: threading.Event | None, stage: str) -> None:
    """Raise Abandoned if `cancel` is set; `stage` names what is skipped (for the message)."""
    if cancel is not None and cancel.is_set():
        raise Abandoned(f"the client went away before the {stage}")


class WorkQueue:
    def __init__(
        self,
        workers: int,
        queue_size: int,
        retry_after_s: int = 2,
        initializer: Callable[[], None] | None = None,
    ):
        """`initializer` runs once on each worker thread (e.g.
        `engine.serving.threads.single_threaded`)."""
        self.workers = workers
        self.capacity = workers + queue_size
        self.retry_after_s = retry_after_s
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kvmosaic-worker", initializer=initializer
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when nothing runs or waits
        self._pending = 0  # running + waiting
        self._running = 0
        self.num_rejected = 0
        self.num_completed = 0
        self.num_dropped = 0  # cancellable jobs dropped unrun: their client had gone

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._pending - self._running

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job runs or waits, at most `timeout` seconds; True if idle then.
        Woken by the job that finishes last, so a waiter costs nothing while the queue works."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def can_submit(self) -> bool:
        return self._pending < self.capacity

    def submit(self, fn: Callable[[*Args], T], *args: *Args) -> Future[T]:
        """Start `fn(*args)` on a worker, or raise QueueFull at once."""
        with self._lock:
            if self._pending >= self.capacity:
                self.num_rejected += 1
                raise QueueFull(self.retry_after_s)
            self._pending += 1
        try:
            return self._executor.submit(self._run, partial(fn, *args))
        except RuntimeError:  # shut down
            self._finish(started=False)
            raise QueueFull(self.retry_after_s) from None

    def submit_cancellable(
        self, cancel: threading.Event, fn: Callable[[*Args], T], *args: *Args
    ) -> Future[T]:
        """`submit`, but a worker that picks the job up with `cancel` set drops it: the
        future then raises Abandoned and `fn` never runs."""
        return self.submit(self._unless_cancelled, cancel, partial(fn, *args))

    async def run(self, fn: Callable[[*Args], T], *args: *Args) -> T:
        """Submit and await the result from the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def _run(self, job: Callable[[], T]) -> T:
        with self._lock:
            self._running += 1
        try:
            return job()
        finally:
            self._finish(started=True)

    def _unless_cancelled(self, cancel: threading.Event, job: Callable[[], T]) -> T:
        if cancel.is_set():
            with self._lock:
                self.num_dropped += 1
            raise Abandoned("the client went away while its request waited")
        return job()

    def _finish(self, started: bool) -> None:
        with self._lock:
            self._pending -= 1
            self._running -= int(started)
            self.num_completed += int(started)
            if self._pending == 0:
                self._idle.notify_all()
