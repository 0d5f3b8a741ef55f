"""A small file system a test makes itself, to fill up as a full disk (issue #50's probe).

`small_volume(path)` mounts a tmpfs of a few MiB at `path` (root only: CI runs as root) and
skips the test, saying why, where mounting is not possible; `fill(path)` writes a filler file
until the volume has no byte left and returns it, so the test frees the space by deleting it.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_volume(path: Path, size: str = "6m") -> Iterator[Path]:
    """A tmpfs of `size` at `path` for the block; the test is skipped if it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    if shutil.which("mount") is None:
        pytest.skip("no mount command here to make a small tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path}: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        # lazy: a connection the failing test left open must not keep the mount
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(volume: Path) -> Path:
    """Write zeros to `volume/filler` until the volume is full (to the last byte); the file."""
    filler = volume / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 1 << 12, 1):
            block = bytes(size)
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return filler


def free_bytes(volume: Path) -> int:
    stats = os.statvfs(volume)
    return stats.f_bavail * stats.f_frsize


@contextmanager
def catalog_full(catalog) -> Iterator[None]:
    """SQLite's own "database or disk is full" without a mount: every connection of `catalog`
    may not grow the database past its size now (`PRAGMA max_page_count`), so an insert that
    needs a new page fails as on a full disk (SQLITE_FULL). Writes in place still work."""
    from sqlalchemy import event

    def limit(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        try:
            pages = cursor.execute("PRAGMA page_count").fetchone()[0]
            cursor.execute(f"PRAGMA max_page_count = {pages}")
        finally:
            cursor.close()

    engine = catalog.engine
    event.listen(engine, "connect", limit)
    engine.dispose()  # pooled connections come back with the limit
    try:
        yield
    finally:
        event.remove(engine, "connect", limit)
        engine.dispose()
