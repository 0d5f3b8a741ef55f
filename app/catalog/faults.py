"""The catalog's errors, and the writes the database refused: no space, a read-only or
failing volume.

`CatalogError`: a write broke an integrity rule. `unwritable_reason(exc)` says whether an
error is a refused write, and why in words; the catalog then raises `CatalogUnwritable` (its
transaction was rolled back: nothing of that write is stored) and notes it in its
`WriteHealth`, which `/readyz` and `/metrics` read: degraded from the first refused write
until one works again, logged once at each change, as the KV store's degraded tiers are
(`app/store/tiered.py`). Other database errors are not this module's.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from pathlib import Path

from sqlalchemy.exc import DBAPIError

from engine.errors import KvMosaicError

log = logging.getLogger(__name__)

# SQLite primary result codes of a volume that cannot take a write.
SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL = 8, 10, 13
# PostgreSQL SQLSTATEs of the same: disk_full, io_error, read_only_sql_transaction.
PG_UNWRITABLE = {"53100": "disk full", "58030": "I/O error", "25006": "read-only transaction"}


class CatalogError(KvMosaicError):
    """A catalog write broke an integrity rule; nothing of it was stored."""


class CatalogUnwritable(CatalogError):
    """The database refused a write (no space, a read-only or failing volume); the transaction
    was rolled back. `reason` is the database's own words; `outcome` what the caller's request
    did not do."""

    def __init__(self, reason: str, outcome: str = "nothing of that write was stored"):
        self.reason = reason
        self.outcome = outcome
        super().__init__(f"the catalog cannot write ({reason}): {outcome}")


def unwritable_reason(exc: BaseException, volume: Path | None = None) -> str | None:
    """Why the database refused a write, if `exc` says it could not write (else None).
    `volume`: the SQLite file's directory, to say when the refusal is a full volume that
    SQLite reports as an I/O error (its shared-memory file could not grow)."""
    error = exc.orig if isinstance(exc, DBAPIError) else exc
    if isinstance(error, sqlite3.Error):
        code = getattr(error, "sqlite_errorcode", None)
        if code is None or code & 0xFF not in (SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL):
            return None
        reason = f"{error} ({getattr(error, 'sqlite_errorname', code)})"
        if code & 0xFF != SQLITE_FULL and volume is not None and _full(volume):
            reason += f": no space left on {volume}"
        return reason
    state = getattr(error, "sqlstate", None)
    if isinstance(state, str) and state in PG_UNWRITABLE:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"{first_line or PG_UNWRITABLE[state]} (SQLSTATE {state})"
    return None


def _full(volume: Path) -> bool:
    return free_bytes(volume) < 64 * 1024


def free_bytes(volume: Path | None) -> int:
    """Bytes an unprivileged writer may still use on `volume` (0 if unknown)."""
    if volume is None:
        return 0
    try:
        stats = os.statvfs(volume)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


class WriteHealth:
    """Thread-safe: whether `name`'s last write failed (`error`, None when it works) and how
    many writes failed (`failures`, for /metrics)."""

    def __init__(self, name: str):
        self.name = name
        self.error: str | None = None
        self.failures = 0
        self._lock = threading.Lock()

    def failed(self, reason: str, counted: bool = True) -> None:
        """A write failed (`counted`: a real write, not a probe)."""
        with self._lock:
            began = self.error is None
            self.error = reason
            self.failures += counted
        if began:
            log.error(
                "%s cannot write, degraded (it still serves reads; writes are refused until "
                "it can): %s",
                self.name,
                reason,
            )

    def succeeded(self) -> None:
        with self._lock:
            ended = self.error is not None
            self.error = None
        if ended:
            log.warning("%s can write again", self.name)
