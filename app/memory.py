"""Keep the server's resident memory from creeping: glibc malloc arenas and trimming.

Where the memory of a long-running server goes (measured with the soak in tests/app/test_soak.py;
figures in docs/benchmarks/memory.md): torch allocates CPU tensors with glibc malloc. Every thread
that allocates may get its own malloc arena (up to 8 per core) and each arena keeps what its
thread freed for reuse, and glibc's dynamic mmap threshold moves large blocks (activations,
attention scores, chunk KV of megabytes) from mmap into those arenas after the first free.
So memory freed by a finished request, an evicted KV entry or a cleared cache stays in the
process, spread over arenas, and RSS only grows. Torch itself keeps no CPU allocation cache,
and request state is dropped when the request ends.

Two remedies, both glibc-only (elsewhere they do nothing):
- `limit_arenas(n)`: at most n arenas (`mallopt(M_ARENA_MAX)`), as `MALLOC_ARENA_MAX` would
  at exec time; threads then share arenas and reuse each other's free memory.
- `Trimmer`: after the server has gone idle, `malloc_trim(0)` hands free pages of every
  arena back to the kernel. Idle only, because trimming walks the heaps and its cost would
  land on a request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # from glibc's malloc.h


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both exist only in glibc
    except (OSError, AttributeError):
        return None
    return libc


LIBC = _libc()


def limit_arenas(count: int) -> bool:
    """Cap glibc's malloc arenas at `count` (0: leave glibc's default). True if applied."""
    if count <= 0 or LIBC is None:
        return False
    applied = bool(LIBC.mallopt(M_ARENA_MAX, count))
    if not applied:
        log.warning("mallopt(M_ARENA_MAX, %d) was refused", count)
    return applied


def trim() -> bool:
    """Return free heap memory of every arena to the kernel; True if any was released."""
    return LIBC is not None and bool(LIBC.malloc_trim(0))


class Trimmer:
    """Calls `trim()` once the server is idle after some work, at most every `interval_s`.

    `is_idle()` says whether nothing runs or waits now; `note_work()` says work happened
    (call it when a request finishes). A thread checks every `interval_s`; `close()` stops it.
    """

    def __init__(self, is_idle: Callable[[], bool], interval_s: float):
        self.is_idle = is_idle
        self.interval_s = interval_s
        self.num_trims = 0
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="malloc-trim", daemon=True)
        if interval_s > 0 and LIBC is not None:
            self._thread.start()

    def note_work(self) -> None:
        self._dirty.set()

    def trim_now(self) -> None:
        """Trim at once (after a cache clear: a large amount was just freed)."""
        self._dirty.clear()
        if trim():
            self.num_trims += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._dirty.is_set() and self.is_idle():
                try:
                    self.trim_now()
                except Exception:  # never let housekeeping kill its thread
                    log.exception("malloc_trim failed")
