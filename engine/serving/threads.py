"""Which threads compute, and with how many cores.

On a CPU, PyTorch parallelises an operation with OpenMP, and every thread that runs one keeps
its own pool of helper threads. While the pools' threads together do not outnumber the cores,
the helpers spin between operations and the next one starts at once; beyond that, OpenMP
(libgomp) cuts their spinning to almost nothing, and every operation pays a wake-up. Decode
steps and blended prefills are thousands of small operations, so this costs them a lot,
while a full prefill (large products) is not slower (docs/benchmarks/batching.md, "Thread
pools"; `engine/serving/scheduler.py` runs the engine's compute on one thread).

So the application sends its model work to that thread (`Engine.compute`: prefills, repairs,
base-KV encodings, embeddings through `Embedder.running_on`); threads that only help (store
loaders, the request workers, the low-priority variant builder, whose builds run beside it)
run torch single-threaded and never form a pool; and work that needs the cores but runs once
on some other thread (loading the models) runs on a passing thread, whose pool ends with it
(a benchmark that built a second engine on its main thread lost most of what batching
buys). A thread that only coordinates must not form one either, and OpenMP work of other
libraries counts too: one FAISS search or one parallel torch operation on the main thread slows
every
later decode step of the compute thread, for good.

Two guards make this the default rather than a rule every thread must remember:
- once a thread pins a count above one (`use_threads`), torch's process-wide count goes back
  to one, so every thread that has not yet run a parallel torch operation (the server's
  event loop and anyio's threads for sync endpoints, a benchmark's main thread) adopts one
  and forms no pool; only threads that pin a count of their own use more;
- the vector index runs FAISS single-threaded on whichever thread calls it
  (`retrieval/index.py`), since libgomp gives each new thread every core whatever torch says.
A thread that adopted torch's count before the first pin keeps it; the benchmarks' main and
client threads still call `single_threaded` for that reason.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


# The compute thread's default count, torch's own default (OMP_NUM_THREADS, else the cores this
# process may run on), read without `torch.get_num_threads()`, which would pin the importing thread.
DEFAULT_THREADS = int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))


def use_threads(count: int) -> None:
    """Make this thread's torch operations use `count` threads, from now on; with `count` above
    one, threads that have not yet chosen keep to one (the module's docstring says why).

    torch keeps one process-wide count that each thread adopts when it first runs a parallel
    operation, and `set_num_threads` changes both that count and the calling thread's; reading
    the count right after setting it makes this thread adopt it at once, so a later change by
    another thread does not reach it. The process-wide count is then set back to one from a
    passing thread, which changes nothing for this one (nor MKL's count here: torch sets it per
    thread). Between the two, for a moment, a thread that adopts gets `count`.
    """
    torch.set_num_threads(count)
    torch.get_num_threads()  # adopts it now (torch's lazy per-thread initialisation)
    if count != 1:
        _on_passing_thread(_one_thread_by_default)


def single_threaded() -> None:
    """Run this thread's torch operations on it alone (no OpenMP pool): the initializer of
    helper threads whose torch work is small or off the critical path."""
    use_threads(1)


def _one_thread_by_default() -> None:
    torch.set_num_threads(1)  # the process-wide count, and this passing thread's own


def in_own_thread(fn: Callable[[], T], threads: int = DEFAULT_THREADS) -> T:
    """Run `fn` on a new thread that uses `threads` threads (`use_threads`), and return its
    result (or raise its error) here; the thread's OpenMP pool, if it formed one, ends with it.
    The caller's own count is neither read nor changed."""

    def pinned() -> T:
        use_threads(threads)
        return fn()

    return _on_passing_thread(pinned)


def _on_passing_thread(fn: Callable[[], T]) -> T:
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as error:  # raised again in the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name="kvmosaic-once")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
