"""A fault injector for store tests: a disk tier that runs out of space on demand."""

from __future__ import annotations

import errno

from app.store.disk import DiskTier

NO_SPACE = "No space left on device"


class FullDisk(DiskTier):
    """A `DiskTier` whose writes fail with ENOSPC while `full` is set, after writing part of
    the temp file (as a real full disk does); `writes` counts the write attempts."""

    full = False
    writes = 0

    def _write(self, path, entry) -> None:
        self.writes += 1
        if self.full:
            path.write_bytes(b"part of an entry")
            raise OSError(errno.ENOSPC, NO_SPACE)
        super()._write(path, entry)

    def check_writable(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, NO_SPACE)
        super().check_writable()
