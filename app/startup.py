"""A start that cannot succeed says so in one line: what is wrong, which file or setting, and what
to do (`StartFailure`), instead of a traceback.

`start_services` runs the checks cheap enough to run first (the data directory can exist, a CUDA
device is there when one is asked for), then `Services.start`; a damaged catalog database or
model file found on the way is named with its fix (restore it, delete it to convert again,
`kvmosaic models pull`). Any other error is left as it is: a bug keeps its traceback. What
does not live here: the settings' own checks (`Settings` validators, at read time).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.exc import DBAPIError

from app.services import Services
from app.settings import Settings
from engine.errors import KvMosaicError

# SQLite's result codes for a file that is not, or no longer, a database.
SQLITE_CORRUPT = 11
SQLITE_NOTADB = 26


class StartFailure(KvMosaicError):
    """The server cannot start; the message is the one line to print."""


def start_services(settings: Settings) -> Services:
    """`Services.start(settings)` after the checks above; StartFailure for the failures they
    and `explain` know."""
    check_data_dir(settings.data_dir)
    check_device(settings.device)
    try:
        return Services.start(settings)
    except Exception as exc:
        failure = explain(exc, settings)
        if failure is None:
            raise
        raise failure from exc


def check_data_dir(data_dir: Path) -> None:
    """The data directory exists or can be made (one that cannot be written is a degraded,
    read-only start, not a failure)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartFailure(
            f"KVMOSAIC_DATA_DIR={data_dir}: cannot create it ({exc.strerror or exc}); set it to "
            "a directory this user can create or use"
        ) from None
    if not data_dir.is_dir():
        raise StartFailure(f"KVMOSAIC_DATA_DIR={data_dir}: not a directory; set it to one")


def check_device(device: str) -> None:
    """A CUDA device is only asked for where torch sees one."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise StartFailure(
            f"KVMOSAIC_DEVICE={device}: no CUDA device is available to this process (or torch "
            "was built without CUDA); use KVMOSAIC_DEVICE=cpu"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise StartFailure(
            f"KVMOSAIC_DEVICE={device}: this process sees {torch.cuda.device_count()} CUDA "
            "device(s); name one of them"
        )


def explain(exc: BaseException, settings: Settings) -> StartFailure | None:
    """The one-line failure for a start-up error kvmosaic knows the fix of; None otherwise."""
    for cause in chain(exc):
        if isinstance(cause, DBAPIError) and isinstance(cause.orig, sqlite3.DatabaseError):
            code = getattr(cause.orig, "sqlite_errorcode", None)
            if code is not None and code & 0xFF in (SQLITE_CORRUPT, SQLITE_NOTADB):
                return damaged_catalog(settings, cause.orig)
        if type(cause).__name__ == "SafetensorError":
            return damaged_model(settings, cause)
    return None


def chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what caused it, outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def damaged_catalog(settings: Settings, error: sqlite3.DatabaseError) -> StartFailure:
    from app.catalog.db import sqlite_file

    file = sqlite_file(settings.catalog_config().resolved_url())
    return StartFailure(
        f"the catalog {file} is damaged or not a SQLite database ({error}): restore it from a "
        "backup, or move it away to start with an empty catalog (then ingest the documents "
        "again)"
    )


def damaged_model(settings: Settings, error: BaseException) -> StartFailure:
    """Name the model file that cannot be read and the way to get a good one."""
    from engine.model.known import Embedded, checkpoint_dir, configured_known_model

    known = configured_known_model(settings.model, settings.model_path)
    if known is None and settings.model_path is not None and not is_gguf(settings.model_path):
        folder, fix = Path(settings.model_path), "restore the checkpoint from where it came from"
    elif known is None:
        from engine.model.gguf import gguf_checkpoint

        folder = gguf_checkpoint(settings.data_dir, Path(str(settings.model_path)))
        fix = f"delete {folder} to convert the .gguf again at the next start"
    else:
        folder = checkpoint_dir(settings.data_dir, known)
        fix = (
            f"delete {folder} to convert it again at the next start"
            if isinstance(known.source, Embedded)
            else f"delete {folder}, then run `kvmosaic models pull {known.name}`"
        )
    files = [str(f) for f in unreadable_safetensors(folder)] or [str(folder)]
    return StartFailure(f"the model file {', '.join(files)} cannot be read ({error}): {fix}")


def is_gguf(path: str) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def unreadable_safetensors(folder: Path) -> list[Path]:
    """The `.safetensors` files in `folder` whose header cannot be read."""
    from safetensors import safe_open

    bad = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="np"):
                pass
        except Exception:
            bad.append(path)
    return bad
