"""GGUF files: read the header, refuse what the engine cannot serve, convert once to safetensors.

A GGUF checkpoint (the embedded SmolLM2, a pulled model, any local `.gguf`) is converted once to
a float32 safetensors checkpoint under `data_dir/models/`, because transformers dequantizes the
whole file at every load. The header is read here without loading tensors, so an unsupported
architecture is refused (`UnsupportedModel`, engine/model/families.py) before any tensor is
converted. Conversions write into a staging directory and rename it into place under a lock on
the models folder, so an interrupted one leaves nothing a later start would load, and the next
conversion removes its leftovers. This module converts; which models exist and where they come
from is engine/model/known.py.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from engine.errors import KvMosaicError
from engine.model.families import check_architecture, check_model_type

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
# scalar value types of GGUF metadata: type id -> struct format (little-endian)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# GGUF architecture names that transformers maps to another model type
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# names in a models folder that only an unfinished conversion or pull leaves
STAGING_PREFIXES = (".staging-", ".pull-")
LOCK_NAME = ".lock"
HASHES_NAME = ".gguf-hashes.json"


class NoDiskSpace(KvMosaicError):
    """Not enough free space for a model's files."""


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about itself: scalar metadata and the shape of every tensor."""

    version: int
    metadata: dict[str, Any]  # scalar values only; arrays (vocabulary, merges) are skipped
    tensor_shapes: tuple[tuple[int, ...], ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name", ""))

    @property
    def num_layers(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.block_count")
        return int(value) if value is not None else None

    @property
    def num_elements(self) -> int:
        total = 0
        for shape in self.tensor_shapes:
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total

    @property
    def model_type(self) -> str:
        """The Hugging Face model type transformers gives this architecture; a GGUF of experts
        (`<arch>.expert_count` > 0, e.g. Mixtral as `llama`) is named as the MoE type it is."""
        arch = self.architecture
        model_type = _MODEL_TYPES.get(arch, arch)
        if int(self.metadata.get(f"{arch}.expert_count", 0) or 0) == 0:
            return model_type
        if model_type in ("llama", "mistral"):
            return "mixtral"
        return model_type if model_type.endswith("_moe") else f"{model_type}_moe"


def read_header(path: Path) -> GGUFHeader:
    """Parse the header of the GGUF file at `path` (versions 2 and 3), reading no tensor data.

    KvMosaicError if it is not a GGUF file or is cut short."""
    try:
        with path.open("rb") as f:
            if f.read(4) != MAGIC:
                raise KvMosaicError(f"{path} is not a GGUF file (no GGUF magic at its start)")
            (version,) = _unpack(f, "I")
            if version not in (2, 3):
                raise KvMosaicError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            num_tensors, num_fields = _unpack(f, "QQ")
            metadata: dict[str, Any] = {}
            for _ in range(num_fields):
                key = _string(f)
                (kind,) = _unpack(f, "I")
                value = _value(f, kind)
                if value is not None:
                    metadata[key] = value
            shapes = []
            for _ in range(num_tensors):
                _string(f)
                (dims,) = _unpack(f, "I")
                shapes.append(tuple(_unpack(f, "Q" * dims)))
                _unpack(f, "IQ")  # element type, data offset
    except struct.error as exc:
        raise KvMosaicError(f"{path}: the GGUF header is cut short ({exc})") from exc
    return GGUFHeader(version, metadata, tuple(shapes))


def _unpack(f: IO[bytes], fmt: str) -> tuple[Any, ...]:
    return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))


def _string(f: IO[bytes]) -> str:
    (length,) = _unpack(f, "Q")
    return f.read(length).decode("utf-8", errors="replace")


def _value(f: IO[bytes], kind: int) -> Any:
    """A scalar or string value; an array is skipped (None)."""
    if kind == _STRING:
        return _string(f)
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])[0]
    if kind != _ARRAY:
        raise KvMosaicError(f"unknown GGUF value type {kind}")
    item_kind, count = _unpack(f, "IQ")
    if item_kind in _SCALARS:
        f.seek(count * struct.calcsize("<" + _SCALARS[item_kind]), os.SEEK_CUR)
    else:
        for _ in range(count):
            _value(f, item_kind)
    return None


def check_gguf(path: Path) -> str:
    """Refuse (UnsupportedModel) a GGUF the engine cannot serve, from its header and then from the
    config transformers derives from it, reading no tensor; else describe it for the log."""
    from transformers import AutoConfig

    check_model_type(read_header(path).model_type)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return check_architecture(config)


# ---------------------------------------------------------------------------------------------
# conversion


@contextmanager
def models_lock(folder: Path) -> Iterator[None]:
    """Hold the models folder's lock (every conversion and pull takes it), then remove what
    unfinished ones left: a holder of the lock is the only writer, so every staging name is
    stale."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LOCK_NAME).open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another conversion in %s", folder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            remove_leftovers(folder)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete the staging directories and partial files of unfinished conversions and pulls
    (call with the lock held); returns what was removed."""
    removed = []
    for entry in folder.iterdir():
        if entry.name.startswith(STAGING_PREFIXES) or ".tmp-" in entry.name:
            remove_path(entry)
            removed.append(entry)
    if removed:
        log.warning("removed leftovers of an unfinished conversion: %s", removed)
    return removed


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """NoDiskSpace unless the file system of `folder` has `needed` bytes free."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise NoDiskSpace(
            f"no space left for {what}: {folder} has {free / 1e9:.2f} GB free, it needs "
            f"{needed / 1e9:.2f} GB; free some space (or set KVMOSAIC_DATA_DIR elsewhere) and retry"
        )


@contextmanager
def disk_errors(folder: Path, what: str) -> Iterator[None]:
    """Turn a full disk met while writing `what` into NoDiskSpace, naming the folder."""
    try:
        yield
    except Exception as exc:
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
        if not (full or "No space left" in str(exc)):
            raise
        raise NoDiskSpace(
            f"no space left on the device of {folder} while writing {what}; free some space "
            f"and retry (nothing half-written was kept)"
        ) from exc


def convert_gguf(
    gguf: Path,
    target: Path,
    source: dict[str, Any] | None = None,
    step: Callable[[str], None] = log.warning,
) -> None:
    """Convert `gguf` to a float32 safetensors checkpoint at `target` (a directory), once.

    Call with the models folder's lock held (`models_lock`). Checks the architecture first
    (`check_gguf`); writes `source` (where the file came from; its "model" names it in the
    steps) as `source.json` beside the weights; the directory appears only when complete
    (staging, fsync, rename)."""
    source = {"gguf": gguf.name, **(source or {})}
    label = str(source.get("model", gguf.name))
    step(f"checking {label}: {check_gguf(gguf)}")
    needed = read_header(gguf).num_elements * 4
    check_free_space(target.parent, needed, f"the converted {label}")
    staging = target.with_name(f"{STAGING_PREFIXES[0]}{target.name}")
    started = time.perf_counter()
    try:
        step(f"converting {label} to float32 safetensors (dequantizing its tensors)")
        with disk_errors(target.parent, f"the converted {label}"):
            _write_checkpoint(gguf, staging, step)
            (staging / "source.json").write_text(json.dumps(source, indent=2) + "\n")
            _sync_folder(staging)
        os.replace(staging, target)
    finally:
        remove_path(staging)
    step(f"converted in {time.perf_counter() - started:.0f} s into {target}")


def _write_checkpoint(gguf: Path, folder: Path, step: Callable[[str], None]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    # The dequantized weights are plain float32; without this, save_pretrained refuses.
    model.hf_quantizer = None  # type: ignore[assignment]  # set by from_pretrained; PreTrainedModel does not declare it
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    step(f"writing {folder.name.removeprefix(STAGING_PREFIXES[0])}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _sync_folder(folder: Path) -> None:
    """Flush every file of `folder` to disk, so the renamed checkpoint survives a power cut."""
    for path in folder.iterdir():
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# any local GGUF


def gguf_checkpoint(data_dir: Path, gguf: Path) -> Path:
    """The safetensors checkpoint of a local `.gguf` file, converted on first use into
    `data_dir/models/gguf-<sha256 prefix>` (the same content converts once, wherever it lies).
    An unsupported architecture is refused from the header before the file is even hashed."""
    if not gguf.is_file():
        raise KvMosaicError(f"model path {gguf} is not a file")
    check_model_type(read_header(gguf).model_type)
    folder = data_dir / "models"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"gguf-{content_sha256(gguf, folder)[:16]}"
    if (target / "model.safetensors").exists():
        return target
    with models_lock(folder):
        if not (target / "model.safetensors").exists():
            log.warning("converting %s to safetensors under %s (once)", gguf, target)
            convert_gguf(gguf, target, {"path": str(gguf.resolve())})
    return target


def content_sha256(path: Path, folder: Path) -> str:
    """sha256 of the file at `path`, remembered in `folder` by path, size and mtime so that a
    start does not hash an unchanged file again."""
    record = folder / HASHES_NAME
    stat = path.stat()
    key = str(path.resolve())
    stamp = [stat.st_size, stat.st_mtime_ns]
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return str(entry["sha256"])
    digest = file_sha256(path)
    known[key] = {"stamp": stamp, "sha256": digest}
    partial = folder / f"{STAGING_PREFIXES[1]}{HASHES_NAME}.{os.getpid()}"
    try:  # a memo only: a lock holder may sweep the partial file away meanwhile
        partial.write_text(json.dumps(known, indent=1))
        os.replace(partial, record)
    except OSError:
        log.info("could not remember the sha256 of %s", path)
    return digest


def file_sha256(path: Path, advance: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
            if advance is not None:
                advance(len(block))
    return h.hexdigest()
