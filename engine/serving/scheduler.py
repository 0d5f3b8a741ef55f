"""Continuous batching of decode: every active request advances one token per step, in one batch.

A request joins after its prefill (`submit`) and leaves when it stops (EOS, token budget, full
cache) or is cancelled; between steps the scheduler admits waiting requests, first come first
served, up to `max_batch` requests and `max_batch_tokens` cache rows. A step picks each
request's next token from its own logits with its own sampling parameters and random
generator (so its tokens do not depend on its companions), streams it, then runs one
`decode_batch` for the requests that go on: linear layers once for all, attention per request.

The scheduler's thread is also where the engine computes (`call`): prefills, guard repairs and
base-KV encodings queue there and run first come first served, so a prefill waits at most for
the step under way (one token), never for the batch to finish, and one thread computes
everything. That matters on a CPU: each thread that runs torch operations keeps its own OpenMP
pool, and once the pools' threads outnumber the cores libgomp stops letting them spin between
operations, so each of a step's thousands of small operations pays a wake-up
(`engine/serving/threads.py`; docs/benchmarks/batching.md, "Scheduler thread").
With `prefill_slots` > 1, prefills run on their callers' threads instead, holding a
`prefill_turn()` (no step starts while one is held or awaited); on a CPU, concurrent prefills
only share the cores and all finish late.

Decoding requests do not wait for whole prefills either (chunked prefill, cut where the engine
already cuts its work): a computation offers the scheduler points between its layers and
between blocks of a layer's rows (`interleave`), and a step runs there once the requests have
waited `decode_gap_s` for their next token. The step touches only the decoding requests'
caches, so the computation's results do not change, only when they come; between queued
computations, a due step goes before the next one.

What batching buys depends on the cores and the linear kernel: a step is mostly weight
traffic (docs/benchmarks/batching.md).

The scheduler knows nothing about text; it streams token ids (`engine.model.decode.stream_text`
turns them into text on the consumer's thread).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import torch

from engine.errors import EngineClosed
from engine.kv import KVCache
from engine.model.decode import (
    Fired,
    SamplingParams,
    StepCheck,
    decode_batch,
    new_generator,
    pick_token,
)
from engine.model.layers import DecoderStack
from engine.serving.threads import DEFAULT_THREADS, use_threads

log = logging.getLogger(__name__)

T = TypeVar("T")


class _End(enum.Enum):
    """The type of `_END` (an enum member, so `item is _END` narrows a queue item's type)."""

    END = enum.auto()


_END = _End.END  # a sequence's last item: it stopped, normally or cancelled

# The scheduler thread ends after this long without work (and starts again on demand), so an
# engine that is dropped without `close` leaves no thread behind.
IDLE_EXIT_S = 5.0


class _Sequence:
    """One request's decode state. The scheduler thread alone calls `advance` and `fail`."""

    def __init__(
        self,
        cache: KVCache,
        first_logits: torch.Tensor,
        params: SamplingParams,
        eos_ids: tuple[int, ...],
        check: StepCheck | None = None,
        generator: torch.Generator | None = None,
    ):
        self.cache, self.logits, self.params, self.eos_ids = cache, first_logits, params, eos_ids
        self.check = check
        self.generator = (
            new_generator(params.seed, first_logits.device) if generator is None else generator
        )
        self.num_picked = 0
        self.token = -1  # the last token picked, whose K/V the next step computes
        # ids, then _END, the check's verdict or an error: the queue hands each item over from
        # the scheduler thread to the stream's reader (nothing else of this object is shared)
        self.out: queue.SimpleQueue[int | _End | Fired | BaseException] = queue.SimpleQueue()
        self.cancelled = False

    @property
    def rows(self) -> int:
        """Cache rows this request holds (its share of the batch's token bound)."""
        return self.cache.capacity

    def advance(self) -> bool:
        """Pick and stream the next token; True if the request needs a decode step for it.

        The same stop rules as `engine.model.decode.generate_ids`: an EOS token ends it unstreamed;
        the token budget or a full cache end it after the token; a firing `check` ends it
        before the token is picked, its verdict the stream's last item.
        """
        fired = self.check.fired(self.num_picked, self.logits) if self.check is not None else None
        if fired is not None:
            self.out.put(fired)
            return False
        token = pick_token(self.logits, self.params, self.generator)
        self.num_picked += 1
        if token in self.eos_ids:
            self.out.put(_END)
            return False
        self.out.put(token)
        if (
            self.num_picked == self.params.max_new_tokens
            or self.cache.length >= self.cache.capacity
        ):
            self.out.put(_END)
            return False
        self.token = token
        return True

    def fail(self, error: BaseException) -> None:
        self.out.put(error)


class _Job(Generic[T]):
    """A piece of compute (a prefill, an encoding pass) to run on the scheduler thread."""

    def __init__(self, fn: Callable[[], T]):
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as error:  # handed to the caller's thread, which raises it
            self.error = error
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def wait(self) -> T:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]  # set by run() when error is None


class TokenStream:
    """One request's token ids, as the scheduler picks them; `close` cancels the request. Its
    end carries the check's verdict as `generate_ids`'s does (`engine.model.decode.ended_by`):
    the verdict is made on the scheduler thread and read here only after it came through the
    queue, so no check state is shared between the two threads."""

    def __init__(self, scheduler: DecodeScheduler, seq: _Sequence):
        self._scheduler, self._seq, self._done = scheduler, seq, False

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        if self._done:
            raise StopIteration
        item = self._seq.out.get()
        if isinstance(item, int):
            return item
        self.close()
        if isinstance(item, BaseException):
            raise item
        raise StopIteration(item if isinstance(item, Fired) else None)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._scheduler._cancel(self._seq)

    def __del__(self) -> None:
        self.close()


class DecodeScheduler:
    """Runs the decode steps of every submitted request on one thread; thread-safe."""

    def __init__(
        self,
        stack: DecoderStack,
        max_batch: int = 8,
        max_batch_tokens: int = 65536,
        prefill_slots: int = 1,
        invariant: bool = False,
        num_threads: int | None = None,
        decode_gap_s: float = 0.1,
    ):
        if max_batch < 1 or max_batch_tokens < 1 or prefill_slots < 1:
            raise ValueError("max_batch, max_batch_tokens and prefill_slots must be >= 1")
        if decode_gap_s < 0:
            raise ValueError("decode_gap_s must be >= 0")
        self.stack = stack
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        # how long decoding requests wait for a step while compute queues or runs
        self.decode_gap_s = decode_gap_s
        self.invariant = invariant
        self.num_threads = num_threads or DEFAULT_THREADS  # torch threads of the scheduler thread
        self._cond = threading.Condition()
        self._jobs: deque[_Job[Any]] = deque()  # compute to run before the next step, in order
        self._waiting: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []  # changed by the scheduler thread only, under the lock
        self._prefills = 0  # requests waiting for or holding a prefill slot
        self._slots = threading.BoundedSemaphore(prefill_slots)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_step = 0.0  # time.perf_counter() at the end of the last step
        # whether the loop's last work was a step: then a queued job goes next, so that jobs
        # and due steps alternate and neither waits for the other's whole line
        self._stepped_last = False
        self.num_steps = 0
        self.num_tokens = 0  # tokens computed by decode steps (rows, padding excluded)
        self.num_interleaved = 0  # steps run inside a computation (`interleave`)

    # -- the request side ----------------------------------------------------------------------

    def submit(
        self,
        cache: KVCache,
        first_logits: torch.Tensor,
        params: SamplingParams,
        eos_ids: tuple[int, ...],
        check: StepCheck | None = None,
        generator: torch.Generator | None = None,
    ) -> TokenStream:
        """Queue a prefilled request at once; returns its generated token ids as they come.

        The EOS token that ends generation is not yielded. Closing the stream early (or
        dropping it) cancels the request: it leaves the batch before the next step. `check`
        and `generator` as in `engine.model.decode.generate_ids`.
        Raises EngineClosed if the scheduler has been closed.
        """
        seq = _Sequence(cache, first_logits, params, eos_ids, check, generator)
        self._enqueue(self._waiting, seq)
        return TokenStream(self, seq)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the scheduler thread, before any further decode step and after the jobs
        queued before it; return its result or raise its error in the caller's thread.

        Engine compute goes through here so that one thread runs it all (see the module
        docstring: OpenMP pools of several threads slow each other down). Called from the
        scheduler thread itself (a job that calls again), `fn` runs at once.
        Raises EngineClosed if the scheduler is closed before `fn` runs.
        """
        if threading.current_thread() is self._thread:
            return fn()
        job = _Job(fn)
        self._enqueue(self._jobs, job)
        return job.wait()

    def interleave(self) -> None:
        """A point inside a long computation (between two layers of a prefill) where a decode
        step may run: it does when a request can join the batch, or requests are decoding and
        their last step ended `decode_gap_s` ago or more (`_step_due`). The step changes only
        the decoding requests' state, so the computation goes on as if it had not run. A no-op
        off the scheduler thread (prefills on their callers' threads with `prefill_slots` > 1,
        the variant builder) and while a prefill turn is held or awaited.
        """
        if threading.current_thread() is not self._thread or not self._step_due():
            return
        with self._cond:
            if self._closed or self._prefills:
                return
            batch = self._batch()
        if batch:
            self.num_interleaved += 1
            self._step(batch)

    def _step_due(self) -> bool:
        """Whether a step is due: a request that can join the batch waits (its first token is
        ready: the step streams it), or decoding requests have waited `decode_gap_s` since the
        last step. Read without the lock: a stale answer moves a step by one pause point."""
        if self._can_join():
            return True
        waited = time.perf_counter() - self._last_step
        return bool(self._active) and waited >= self.decode_gap_s

    def _can_join(self) -> bool:
        """Whether the first waiting request fits the batch now (`_fits`)."""
        active_rows = sum(seq.rows for seq in self._active)
        return bool(self._waiting) and self._fits(self._waiting[0], active_rows)

    def _fits(self, seq: _Sequence, active_rows: int) -> bool:
        """Whether `seq` may join the batch beside its `active_rows` cache rows: a place is free
        and the rows stay within bounds (a lone request fits whatever its size)."""
        if not self._active:
            return True
        return (
            len(self._active) < self.max_batch and active_rows + seq.rows <= self.max_batch_tokens
        )

    def _enqueue(self, line: deque[Any], item: object) -> None:
        """Append `item` to one of the scheduler's lines and wake its thread (starting one if
        none runs); EngineClosed once the scheduler is closed."""
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is shutting down")
            line.append(item)
            self._start_thread()
            self._cond.notify_all()

    def _cancel(self, seq: _Sequence) -> None:
        seq.cancelled = True  # a no-op once it has stopped
        with self._cond:
            self._cond.notify_all()

    @contextmanager
    def prefill_turn(self) -> Iterator[None]:
        """Hold a prefill slot; no decode step starts while any request waits for or holds one."""
        with self._cond:
            self._prefills += 1
        try:
            with self._slots:
                yield
        finally:
            with self._cond:
                self._prefills -= 1
                self._cond.notify_all()

    # -- facts ---------------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop after the step under way; requests still decoding get EngineClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # -- the scheduler thread ------------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvmosaic-decode", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        # its own count, whatever helper threads set (engine/serving/threads.py)
        use_threads(self.num_threads)
        try:
            while (work := self._next_work()) is not None:
                if isinstance(work, _Job):
                    work.run()
                else:
                    self._step(work)
        except BaseException as error:
            # a bug here must not leave callers waiting on a dead thread: they get the error,
            # and the next request starts a fresh thread
            log.exception("the decode scheduler failed")
            self._fail_all(error, restartable=True)
            return
        with self._cond:
            if self._closed:
                self._fail_all(EngineClosed("the engine is shutting down"))

    def _fail_all(self, error: BaseException, restartable: bool = False) -> None:
        """Fail every request and job still queued or decoding; with `restartable`, forget this
        thread so that the next request starts another."""
        with self._cond:
            for seq in [*self._active, *self._waiting]:
                seq.fail(error)
            for job in self._jobs:
                job.fail(error)
            self._active, self._waiting, self._jobs = [], deque(), deque()
            if restartable and self._thread is threading.current_thread():
                self._thread = None

    def _next_work(self) -> _Job[Any] | list[_Sequence] | None:
        """Wait for work: the oldest job first, unless a step is due (`interleave`) and the last
        work was a job; else, when no prefill turn is held or awaited, the batch for the next
        step (admitting waiting requests). None once closed or idle."""
        with self._cond:
            while (
                not self._closed
                and not self._jobs
                and (self._prefills or not (self._active or self._waiting))
            ):
                if not self._cond.wait(IDLE_EXIT_S) and not (
                    self._jobs or self._active or self._waiting
                ):
                    self._thread = None  # idle: the thread ends (the next submit starts one)
                    return None
            if self._closed:
                return None
            if self._jobs and (self._prefills or self._stepped_last or not self._step_due()):
                self._stepped_last = False
                return self._jobs.popleft()
            self._stepped_last = True
            return self._batch()

    def _batch(self) -> list[_Sequence]:
        """The next step's batch: cancelled requests dropped, waiting ones admitted (under the
        lock)."""
        self._active = [seq for seq in self._active if not seq.cancelled]
        self._admit()
        return list(self._active)

    def _admit(self) -> None:
        """Move waiting requests into the batch in arrival order while both bounds hold
        (a lone request is admitted whatever its size; nobody overtakes a waiting request)."""
        rows = sum(seq.rows for seq in self._active)
        while self._waiting:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                continue
            if not self._fits(seq, rows):
                return
            self._active.append(self._waiting.popleft())
            rows += seq.rows

    @staticmethod
    def _advance(seq: _Sequence) -> bool:
        """`seq.advance()`; an error fails that request alone (the thread serves the others)."""
        try:
            return seq.advance()
        except Exception as error:
            log.exception("picking a token failed")
            seq.fail(error)
            return False

    def _step(self, batch: Sequence[_Sequence]) -> None:
        """One token for every request of the batch (see the module docstring)."""
        going = [seq for seq in batch if not seq.cancelled and self._advance(seq)]
        if going:
            try:
                logits = decode_batch(
                    self.stack,
                    [seq.cache for seq in going],
                    [seq.token for seq in going],
                    invariant=self.invariant,
                    max_rows=self.max_batch,
                )
            except Exception as error:  # e.g. out of memory: these requests fail, the others go on
                log.exception("decode step failed for %d requests", len(going))
                for seq in going:
                    seq.fail(error)
                going = []
            else:
                for seq, row in zip(going, logits):
                    seq.logits = row
                self.num_steps += 1
                self.num_tokens += len(going)
        with self._cond:
            kept = set(map(id, going))
            self._active = [seq for seq in self._active if id(seq) in kept]
        self._last_step = time.perf_counter()
