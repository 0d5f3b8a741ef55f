"""The `disk` tier: one safetensors file per entry under a directory.

Files are `<dir>/<key[:2]>/<key>.kvs`, named from the key (a hex digest) only. A put writes
a temp file in the same directory, fsyncs it, renames it over the target and fsyncs the
directory, so a crash leaves either the old file, the new one, or a stray temp file (removed
at the next start) — never a torn entry. Readers keep their file descriptor, so an entry
replaced or removed while being read stays readable to them.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import uuid
from pathlib import Path

import torch

from app.store import codec
from app.store.base import BaseTier, EntryReader, check_key
from app.store.config import StoreConfig
from app.store.entry import CorruptEntry, KVEntry

log = logging.getLogger(__name__)

SUFFIX = ".kvs"
TEMP_SUFFIX = ".tmp"
PROBE_PREFIX = ".probe-"
PROBE_BYTES = 1 << 16  # what `check_writable` writes and deletes again


class _DiskReader(EntryReader):
    """Reads layers with pread on one descriptor (thread-safe, no shared file offset)."""

    def __init__(self, fd: int, layout: codec.EntryLayout):
        self.meta = layout.meta
        self._fd = fd
        self._layout = layout

    def layer(self, index: int) -> torch.Tensor:
        start, end = self._layout.offsets[index]
        buffer = bytearray(end - start)
        got = os.preadv(self._fd, [buffer], start)
        if got != len(buffer):
            raise CorruptEntry(f"layer {index} truncated ({got} of {len(buffer)} bytes)")
        return codec.decode_layer(self._layout, index, buffer)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_layout(fd: int) -> codec.EntryLayout:
    """Read and validate the header of an open entry file."""
    size = os.fstat(fd).st_size
    length = codec.header_length(os.pread(fd, 8, 0))
    return codec.parse_header(os.pread(fd, 8 + length, 0), size)


class DiskTier(BaseTier):
    name = "disk"

    def __init__(self, capacity_bytes: int, directory: Path, fsync: bool = True):
        super().__init__(capacity_bytes)
        self.directory = Path(directory)
        self.fsync = fsync
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._used = 0
        self._scan()

    @classmethod
    def from_config(cls, config: StoreConfig, check: bool = True) -> DiskTier:
        return cls(config.disk_bytes, config.disk_dir, config.disk_fsync)

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{check_key(key)}{SUFFIX}"

    # -- contract ------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    def put(self, key: str, entry: KVEntry) -> None:
        target = self.path(key)
        target.parent.mkdir(exist_ok=True)
        temp = target.with_name(f".{key}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")
        try:
            self._write(temp, entry)
            with self._lock:  # rename and bookkeeping together, so remove() cannot interleave
                os.replace(temp, target)
                self._account(key, entry.num_bytes)
        finally:
            temp.unlink(missing_ok=True)
        if self.fsync:
            _fsync_directory(target.parent)

    def get(self, key: str) -> KVEntry | None:
        try:
            with open(self.path(key), "rb", buffering=0) as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                _read_fully(f, data)
        except FileNotFoundError:
            self._forget(key)
            return None
        return codec.decode(data)  # wraps `data` without another copy

    def open(self, key: str) -> EntryReader | None:
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return None
        try:
            return _DiskReader(fd, open_layout(fd))
        except BaseException:
            os.close(fd)
            raise

    def discard(self, key: str) -> bool:
        with self._lock:
            try:
                os.unlink(self.path(key))
                existed = True
            except FileNotFoundError:
                existed = False
            self._account(key, None)
            return existed

    def keys(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sizes)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def close(self) -> None:
        """Nothing to release: files stay for the next start."""

    def check_writable(self) -> None:
        """Write, sync and delete a small probe file; OSError (ENOSPC, EROFS, EIO) if it fails."""
        probe = self.directory / f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
        try:
            with open(probe, "wb") as f:
                f.write(bytes(PROBE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)

    # -- internals -----------------------------------------------------------------------------

    def _write(self, path: Path, entry: KVEntry) -> None:
        header, layers = codec.encode_parts(entry)
        with open(path, "wb") as f:
            f.write(header)
            for buffer in layers:
                f.write(buffer)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _account(self, key: str, size: int | None) -> None:
        """Set (or with None, drop) key's size; caller holds the lock."""
        self._used -= self._sizes.pop(key, 0)
        if size is not None:
            self._sizes[key] = size
            self._used += size

    def _forget(self, key: str) -> None:
        """The file vanished behind our back (deleted by hand): drop it from the accounting."""
        with self._lock:
            if not self.path(key).exists():
                self._account(key, None)

    def _scan(self) -> None:
        """Index existing files; delete stray temp files and files whose header is unreadable;
        then hold to the capacity (it may have been lowered since the files were written)."""
        for path in [
            *self.directory.glob(f"*/.*{TEMP_SUFFIX}"),
            *self.directory.glob(f"{PROBE_PREFIX}*"),
        ]:
            path.unlink(missing_ok=True)
        for path in self.directory.glob(f"*/*{SUFFIX}"):
            key = path.name[: -len(SUFFIX)]
            try:
                check_key(key)
                fd = os.open(path, os.O_RDONLY)
                try:
                    size = open_layout(fd).meta.num_bytes
                finally:
                    os.close(fd)
            except (ValueError, CorruptEntry, OSError) as exc:
                log.warning("removing unreadable KV file %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            self._account(key, size)
        self._shrink_to_capacity()

    def _shrink_to_capacity(self) -> None:
        """Delete the least recently written files until the tier fits its capacity.

        Runs at start-up only, before any reader or the catalog's reconciliation: the catalog
        then marks the deleted entries missing, and they are recomputed on use. Usage counts
        are not known yet at this point, so the file age stands in for the eviction policy.
        """
        if self._used <= self.capacity_bytes:
            return
        held, removed = self._used, 0
        by_age = sorted(self._sizes, key=lambda key: _mtime(self.path(key)))
        for key in by_age:
            if self._used <= self.capacity_bytes:
                break
            self.path(key).unlink(missing_ok=True)
            self._account(key, None)
            removed += 1
        log.warning(
            "disk tier held %d bytes over its capacity of %d: removed the %d oldest entries (%d "
            "bytes)",
            held,
            self.capacity_bytes,
            removed,
            held - self._used,
        )


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read_fully(f: io.RawIOBase, data: bytearray) -> None:
    view, done = memoryview(data), 0
    while done < len(data):
        got = f.readinto(view[done:])
        if not got:
            raise CorruptEntry(f"entry file shrank while being read ({done} of {len(data)} bytes)")
        done += got


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
