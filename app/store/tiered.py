"""`TieredStore`: the tiers in lookup order, with eviction, demotion, promotion and pins.

- Lookups try the tiers fastest first; a hit below the first tier copies the entry up
  (promotion; the lower copy stays, so a shared Redis keeps serving other replicas).
- A put goes to the first tier (or the one named) with room. Room is made by evicting
  unpinned entries chosen by the policy; an evicted entry is written to the next tier
  (demotion) unless that one holds it already, and dropped only from the last tier.
- An entry that fails validation, or whose metadata is not what the caller expects (other
  model, prefix, tokens), is a miss: counted as `corrupt`, logged, removed, never served.
- A tier that raises `TierUnavailable` (Redis down) is skipped for `retry_s` seconds, then
  tried again; the other tiers keep serving.
- A tier whose write fails (`OSError`: a full or read-only disk) is degraded: it still
  serves reads, but puts and demotions pass it by for `retry_s` seconds, then the next put
  tries it again; `recheck_writes` asks a degraded tier whether it can write again
  (`BaseTier.check_writable`). `stats()` reports the error until a write succeeds.
- Listeners hear `entry_moved(key, tier)` (the fastest tier holding the key changed after a
  demotion or promotion) and `entry_dropped(key)` (no tier holds it any more); the chunk
  cache keeps the catalog's `tier` / `status` columns in step with them.

Writes (put, evictions, promotion, remove) are serialized by one lock; reads are not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, NamedTuple, ParamSpec, Protocol, TypeVar

from app.store.base import BaseTier, EntryReader, TierUnavailable, check_key
from app.store.entry import CorruptEntry, EntryExpectation, EntryMeta, KVEntry
from app.store.events import EventQueue, StoreListener
from app.store.policy import (
    BaseEvictionPolicy,
    EvictionCandidate,
    LruPolicy,
    Usage,
    UsageBook,
    create_policy,
)
from app.store.stats import CountedReader, CounterBook, TierReport
from engine.serving.threads import single_threaded

log = logging.getLogger(__name__)


class _Described(Protocol):
    """What a tier read returns: a whole `KVEntry` or an `EntryReader`, both with a `meta`."""

    @property
    def meta(self) -> EntryMeta: ...


_Item = TypeVar("_Item", bound=_Described)
_Args = ParamSpec("_Args")
_Result = TypeVar("_Result")


@dataclass(frozen=True)
class _Found(Generic[_Item]):
    """A valid copy of a key found by a lookup: what was read, from which tier, and that
    tier's position among the tiers searched (0: the first, nothing to promote)."""

    item: _Item
    tier: BaseTier
    position: int


def _release(item: object) -> None:
    """Let go of a refused read: a reader holds a handle; a whole entry holds nothing."""
    if isinstance(item, EntryReader):
        item.close()


@dataclass
class _WriteFault:
    """Why a tier's last write failed, and when a put may try it again."""

    reason: str
    retry_at: float


class Opened(NamedTuple):
    """An entry opened for layer-wise reads, and the tier it is read from."""

    reader: EntryReader
    tier: str


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[BaseTier],
        policy: BaseEvictionPolicy | None = None,
        retry_s: float = 30.0,
        load_threads: int = 2,
    ):
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tiers: {names}")
        self.tiers = list(tiers)
        self.policy = policy or LruPolicy()
        self.retry_s = retry_s
        self.counters = CounterBook(names)
        # Background readers of layers for lazy loading (see app.store.lazy).
        # Single-threaded, so that they take no cores from the engine's compute
        # (engine/serving/threads.py).
        self.loader = ThreadPoolExecutor(
            max_workers=load_threads, thread_name_prefix="kv-load", initializer=single_threaded
        )
        # Promotions after a request run here, so they never delay the next request's layer reads.
        self._background = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kv-promote", initializer=single_threaded
        )
        self._lock = threading.RLock()
        self._usage = UsageBook()
        self._down_until: dict[str, float] = {}
        self._write_faults: dict[str, _WriteFault] = {}  # tiers whose last write failed
        self._doomed: set[str] = set()
        self._events = EventQueue()
        for tier in self.tiers:  # probe remote tiers once, so a dead Redis is logged at start
            self._guard(tier, tier.used_bytes)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def tier(self, name: str) -> BaseTier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier {name!r} in this store (tiers: {self.names})")

    def subscribe(self, listener: StoreListener) -> None:
        """`listener` hears where entries went after demotions, promotions and drops."""
        self._events.subscribe(listener)

    # -- lookups -------------------------------------------------------------------------------

    def where(self, key: str) -> str | None:
        """Name of the fastest reachable tier holding `key`, or None."""
        for tier in self._live():
            if self._guard(tier, tier.contains, key):
                return tier.name
        return None

    def live_names(self) -> list[str]:
        """Names of the tiers not currently skipped as unreachable."""
        return [t.name for t in self._live()]

    def locations(self) -> dict[str, str]:
        """{key: fastest reachable tier holding it} for every stored key (a snapshot)."""
        found: dict[str, str] = {}
        for tier in reversed(self._live()):
            for key in self._guard(tier, tier.keys) or {}:
                found[key] = tier.name
        return found

    def contains(self, key: str) -> bool:
        return self.where(key) is not None

    def get(self, key: str, expect: EntryExpectation | None = None) -> KVEntry | None:
        """The whole entry from the fastest tier that has a valid one (promoted); None: miss."""
        check_key(key)
        found = self._find(key, self._live(), lambda tier: tier.get(key), expect)
        if found is None:
            return None
        entry = found.item
        # The whole entry was read: the layer-wise path (open) counts its bytes per layer instead.
        self.counters.add(found.tier.name, bytes_read=entry.num_bytes)
        if found.position > 0:
            self._promote(key, entry)
        return entry

    def open(self, key: str, expect: EntryExpectation | None = None) -> Opened | None:
        """Open the entry for layer-wise reads from the fastest tier with a valid header.

        No promotion here (call `promote` once the entry has been used); pin the key while
        reading so it is not evicted underneath.
        """
        check_key(key)
        found = self._find(key, self._live(), lambda tier: tier.open(key), expect)
        if found is None:
            return None
        name = found.tier.name
        return Opened(CountedReader(found.item, self.counters, name), name)

    def promote(self, key: str) -> bool:
        """Copy `key` into the first tier if a lower one holds it; True if it was copied."""
        live = self._live()
        if not live or self._guard(live[0], live[0].contains, key):
            return False
        # Not a lookup on a caller's behalf: no hit, miss or use is recorded.
        found = self._find(key, live[1:], lambda tier: tier.get(key), counted=False)
        return found is not None and self._promote(key, found.item)

    def promote_later(self, key: str) -> None:
        """`promote(key)` on a background thread; does nothing once the store is closed."""
        try:
            self._background.submit(self._promote_quietly, key)
        except RuntimeError:  # shut down
            pass

    def join_promotions(self) -> None:
        """Wait until the promotions queued so far are done (tests, benchmarks): the one
        background worker runs them in order, so a no-op queued now runs after them."""
        try:
            self._background.submit(lambda: None).result()
        except RuntimeError:  # shut down: nothing runs any more
            pass

    def _promote_quietly(self, key: str) -> None:
        try:
            self.promote(key)
        except Exception:  # a failed promotion only costs speed
            log.exception("background promotion of %s failed", key)

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: str, entry: KVEntry, tier: str | None = None) -> str | None:
        """Store `entry` in `tier` (default: the first), or the next tier down with room.

        Returns the name of the tier that took it, or None if none could (every candidate
        full of pinned entries, the entry larger than each capacity, or backends down).
        """
        check_key(key)
        start = self.names.index(tier) if tier is not None else 0
        with self._lock:
            self._usage.used(key, entry.meta.num_tokens, hit=False)
            # Events only for entries this put evicted: the caller knows where `key` went.
            stored = next(
                (
                    t.name
                    for t in self.tiers[start:]
                    if self._available(t) and self._store_in(t, key, entry)
                ),
                None,
            )
        self._deliver()
        return stored

    def remove(self, key: str) -> bool:
        """Remove `key` from every tier; a pinned key goes at its last unpin.

        True if some tier held it (removed now or scheduled).
        """
        check_key(key)
        with self._lock:
            held = self.where(key) is not None
            if self._pinned(key):
                self._doomed.add(key)
                return held
            self._discard_everywhere(key)
            return held

    def pin(self, key: str) -> None:
        """Protect `key` from eviction in every tier until the matching unpin."""
        with self._lock:
            for tier in self.tiers:
                tier.pin(key)

    def unpin(self, key: str) -> None:
        with self._lock:
            for tier in self.tiers:
                tier.unpin(key)
            if key in self._doomed and not self._pinned(key):
                self._doomed.discard(key)
                self._discard_everywhere(key)

    def persist(self, key: str, tier: str) -> bool | None:
        """Copy `key` into `tier` from whichever tier holds it (a memory-only entry whose
        persistent tier could not write). True: `tier` holds it now; False: no tier holds
        it any more (nothing to copy); None: `tier` cannot take it now (try again later)."""
        target = self.tier(tier)
        with self._lock:
            if self._guard(target, target.contains, key):
                return True
            others = [t for t in self._live() if t is not target]
            found = self._find(key, others, lambda t: t.get(key), counted=False)
            if found is None:
                return False
            stored = self._store_in(target, key, found.item)
        self._deliver()
        return True if stored else None

    def recheck_writes(self) -> list[str]:
        """Ask each degraded tier whose retry time has come whether it can write again
        (`BaseTier.check_writable`); returns the names of those that recovered."""
        recovered = []
        with self._lock:
            for tier in self.tiers:
                fault = self._write_faults.get(tier.name)
                if fault is None or time.monotonic() < fault.retry_at:
                    continue
                try:
                    tier.check_writable()
                except OSError as exc:
                    self._mark_unwritable(tier, exc)
                    continue
                self._mark_writable(tier)
                recovered.append(tier.name)
        return recovered

    def write_error(self, name: str) -> str | None:
        """Why tier `name` cannot write now (None: it can, as far as the store knows)."""
        fault = self._write_faults.get(name)
        return fault.reason if fault is not None else None

    def report_corrupt(self, key: str, tier: str, reason: str) -> None:
        """A reader found a bad layer: count it and remove the entry from that tier (pinned or
        not)."""
        self._refuse(key, self.tier(tier), reason)

    # -- admin (what `/admin/evict` and `DELETE /admin/cache` call) ----------------------------

    def evict(
        self, tier: str, num_bytes: int | None = None, policy: str | None = None
    ) -> tuple[int, int]:
        """Evict unpinned entries of `tier` as when making room (demoting them to the next tier):
        victims chosen by `policy` (default: the store's) until `num_bytes` are freed, or all
        of them when `num_bytes` is None. Returns (entries evicted, bytes freed in `tier`)."""
        chooser = create_policy(policy) if policy else self.policy
        target = self.tier(tier)
        entries = freed = 0
        with self._lock:
            sizes = self._guard(target, target.keys) or {}
            while sizes and (num_bytes is None or freed < num_bytes):
                victim = chooser.victim(self._eviction_candidates(target, sizes))
                if victim is None:
                    break
                self._evict(target, victim.key)
                freed += sizes.pop(victim.key)
                entries += 1
        self._deliver()
        return entries, freed

    def clear(self) -> list[str]:
        """Remove every entry from every reachable tier (a pinned one at its last unpin).

        Returns the keys removed; no listener events (the caller updates the catalog in bulk).
        """
        with self._lock:
            keys: set[str] = set()
            for tier in self._live():
                keys.update(self._guard(tier, tier.keys) or {})
            for key in keys:
                if self._pinned(key):
                    self._doomed.add(key)
                else:
                    self._discard_everywhere(key)
        return sorted(keys)

    # -- usage (fed by the chunk cache from the catalog) --------------------------------------

    def set_usage(
        self, key: str, access_count: int | None = None, savings: float | None = None
    ) -> None:
        """Seed what the eviction policy knows of `key` (access count, expected savings in
        tokens)."""
        self._usage.seed(key, access_count, savings)

    def usage(self, key: str) -> Usage:
        return self._usage.get(key)

    # -- reporting -----------------------------------------------------------------------------

    def stats(self) -> list[TierReport]:
        reports = []
        for tier in self.tiers:
            available = self._available(tier)
            info = self._guard(tier, tier.stats) if available else None
            reports.append(
                TierReport(
                    tier.name,
                    info is not None,
                    tier.capacity_bytes,
                    info.used_bytes if info else 0,
                    info.num_entries if info else 0,
                    info.num_pinned if info else 0,
                    self.counters.snapshot(tier.name),
                    self.write_error(tier.name),
                )
            )
        return reports

    def close(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=True)
        self.loader.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:  # closing must not stop closing the others
                log.exception("closing tier %s failed", tier.name)

    # -- internals -----------------------------------------------------------------------------
    # Callers of _store_in, _make_room, _evict, _demote, _discard_everywhere and _after_removal
    # hold self._lock; _promote and _refuse take it themselves; _find takes none (reads are not
    # serialized).

    def _find(
        self,
        key: str,
        tiers: Sequence[BaseTier],
        read: Callable[[BaseTier], _Item | None],
        expect: EntryExpectation | None = None,
        counted: bool = True,
    ) -> _Found[_Item] | None:
        """The first valid copy of `key` that `read(tier)` returns, walking `tiers` in order.

        The lookup ladder, the same for every read: a tier that raises TierUnavailable is
        marked down and skipped; a copy that raises CorruptEntry or is not what `expect` asks
        for is refused (counted `corrupt`, removed from that tier) and skipped; a tier without
        the key is skipped too. When `counted` (a lookup on a caller's behalf), each tier
        without the key counts a miss, and the tier found counts a hit and the key a use. A
        refused reader is closed here; the one returned is the caller's to close. None when
        no tier had a valid copy.
        """
        for position, tier in enumerate(tiers):
            try:
                item = read(tier)
            except TierUnavailable as exc:
                self._mark_down(tier, exc)
                continue
            except CorruptEntry as exc:
                self._refuse(key, tier, str(exc))
                continue
            if item is None:
                if counted:
                    self.counters.add(tier.name, misses=1)
                continue
            reason = expect.mismatch(item.meta) if expect else None
            if reason:
                _release(item)
                self._refuse(key, tier, reason)
                continue
            if counted:
                self.counters.add(tier.name, hits=1)
                self._usage.used(key, item.meta.num_tokens, hit=True)
            return _Found(item, tier, position)
        return None

    def _store_in(self, tier: BaseTier, key: str, entry: KVEntry) -> bool:
        """Make room in `tier` and put the entry there; False if it cannot take it (a
        degraded tier is not tried until its retry time)."""
        fault = self._write_faults.get(tier.name)
        if fault is not None and time.monotonic() < fault.retry_at:
            return False
        if not self._make_room(tier, key, entry.num_bytes):
            return False
        try:
            tier.put(key, entry)
        except TierUnavailable as exc:
            self._mark_down(tier, exc)
            return False
        except OSError as exc:  # disk full, permissions: the next tier may still work
            self.counters.add(tier.name, put_failures=1)
            self._mark_unwritable(tier, exc)
            return False
        self.counters.add(tier.name, puts=1, bytes_written=entry.num_bytes)
        self._mark_writable(tier)
        return True

    def _make_room(self, tier: BaseTier, key: str, num_bytes: int) -> bool:
        if num_bytes > tier.capacity_bytes:
            return False
        sizes = self._guard(tier, tier.keys)
        if sizes is None:
            return False
        used = sum(sizes.values()) - sizes.pop(key, 0)
        while used + num_bytes > tier.capacity_bytes:
            victim = self.policy.victim(self._eviction_candidates(tier, sizes))
            if victim is None:
                return False
            self._evict(tier, victim.key)
            used -= sizes.pop(victim.key)
        return True

    def _eviction_candidates(
        self, tier: BaseTier, sizes: dict[str, int]
    ) -> list[EvictionCandidate]:
        """The unpinned entries of `tier` among `sizes` ({key: payload bytes}), with their usage."""
        return [
            EvictionCandidate(key, size, self.usage(key))
            for key, size in sizes.items()
            if not tier.is_pinned(key)
        ]

    def _evict(self, tier: BaseTier, key: str) -> None:
        """Move `key` from `tier` to the next live tier (if it is valid and fits), else drop it."""
        try:
            entry = tier.get(key)
        except (CorruptEntry, TierUnavailable) as exc:
            log.warning("evicting %s from tier %s without demotion: %s", key, tier.name, exc)
            entry = None
        demoted_to = self._demote(key, entry, tier)
        self._guard(tier, tier.discard, key)
        self.counters.add(tier.name, evictions=1)
        if demoted_to is not None:
            self.counters.add(demoted_to.name, demotions=1)
        self._after_removal(key)

    def _demote(self, key: str, entry: KVEntry | None, tier: BaseTier) -> BaseTier | None:
        """The next live tier below `tier` once it holds `entry` (it had it already, or took
        it now); None if there is no entry to move, no tier below, or it could not take it."""
        lower = self._next_live(tier)
        if entry is None or lower is None:
            return None
        held = bool(self._guard(lower, lower.contains, key)) or self._store_in(lower, key, entry)
        return lower if held else None

    def _promote(self, key: str, entry: KVEntry) -> bool:
        with self._lock:
            live = self._live()
            if (
                not live
                or self._guard(live[0], live[0].contains, key)
                or not self._store_in(live[0], key, entry)
            ):
                return False
            self.counters.add(live[0].name, promotions=1)
            self._events.located(key, live[0].name)
        self._deliver()
        return True

    def _refuse(self, key: str, tier: BaseTier, reason: str) -> None:
        log.warning(
            "KV entry %s in tier %s refused (treated as a miss): %s", key, tier.name, reason
        )
        self.counters.add(tier.name, corrupt=1)
        with self._lock:
            self._guard(tier, tier.discard, key)
            self._after_removal(key)
        self._deliver()

    def _discard_everywhere(self, key: str) -> None:
        for tier in self.tiers:
            if self._available(tier):
                self._guard(tier, tier.discard, key)
        self._usage.forget(key)

    def _after_removal(self, key: str) -> None:
        """Tell listeners where `key` is now, or that it is gone (and forget its usage)."""
        where = self.where(key)
        if where is None:
            self._usage.forget(key)
        self._events.located(key, where)

    def _pinned(self, key: str) -> bool:
        return any(t.is_pinned(key) for t in self.tiers)

    # -- availability and events ---------------------------------------------------------------

    def _live(self) -> list[BaseTier]:
        return [t for t in self.tiers if self._available(t)]

    def _next_live(self, tier: BaseTier) -> BaseTier | None:
        below = self.tiers[self.tiers.index(tier) + 1 :]
        return next((t for t in below if self._available(t)), None)

    def _available(self, tier: BaseTier) -> bool:
        return time.monotonic() >= self._down_until.get(tier.name, 0.0)

    def _mark_down(self, tier: BaseTier, exc: Exception) -> None:
        if self._available(tier):
            log.warning(
                "store tier %s unavailable for %.0fs, serving from the others: %s",
                tier.name,
                self.retry_s,
                exc,
            )
        self._down_until[tier.name] = time.monotonic() + self.retry_s

    def _mark_unwritable(self, tier: BaseTier, exc: OSError) -> None:
        """The tier refused a write: degraded, passed by until `retry_s` from now (lock held)."""
        if tier.name not in self._write_faults:
            log.error(
                "store tier %s cannot write, degraded (writes go to the next tier; retried every "
                "%.0fs): %s",
                tier.name,
                self.retry_s,
                exc,
            )
        self._write_faults[tier.name] = _WriteFault(str(exc), time.monotonic() + self.retry_s)

    def _mark_writable(self, tier: BaseTier) -> None:
        """A write to the tier worked: no longer degraded (lock held)."""
        if self._write_faults.pop(tier.name, None) is not None:
            log.warning("store tier %s can write again", tier.name)

    def _guard(
        self,
        tier: BaseTier,
        operation: Callable[_Args, _Result],
        *args: _Args.args,
        **kwargs: _Args.kwargs,
    ) -> _Result | None:
        """Run a tier operation; None (and the tier marked down) if its backend is unreachable."""
        try:
            return operation(*args, **kwargs)
        except TierUnavailable as exc:
            self._mark_down(tier, exc)
            return None

    def _deliver(self) -> None:
        self._events.deliver()
