"""Load the kernel library with ctypes and decide whether the kernels are used at all.

`KVMOSAIC_KERNELS` chooses:
- `auto` (default): use the kernels for GPU tensors if the library builds and loads; if not,
  log one warning and use the PyTorch twins;
- `off`: always the twins;
- `require`: the kernels or an error (the GPU tests and the device check use this).
`KVMOSAIC_KERNEL_LIBRARY` names a prebuilt library to load instead of building one (for
deployments with a CUDA runtime but no nvcc).

The first call that needs the library builds it (seconds with nvcc; cached afterwards) and
loads it; the outcome, success or failure, is kept for the life of the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import KvMosaicError
from engine.kernels import build

if TYPE_CHECKING:  # typeshed's names for any ctypes data type and a foreign function
    from _ctypes import CFuncPtr, _CDataType

log = logging.getLogger(__name__)

ABI_VERSION = 1  # must equal KVM_ABI_VERSION in csrc/kvmosaic.h
MAX_DIMS = 6  # KVM_MAX_DIMS
MODES = ("auto", "off", "require")


class KernelError(KvMosaicError):
    """A kernel call failed, or the library is required but cannot be had."""


class Layout(ctypes.Structure):
    """`kvm_layout`: sizes and strides in elements, at most MAX_DIMS dims."""

    _fields_ = [
        ("ndim", ctypes.c_int32),
        ("sizes", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
    ]


_p, _i64, _int, _layout = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(Layout)
# name -> argument types, device entry points first; each has a kvm_host_* twin without the stream.
SIGNATURES: dict[str, list[type[_CDataType]]] = {
    "kvm_rope_shift": [_p, _int, _layout, _i64, _p, _p, _int],
    "kvm_kv_deviation": [_p, _layout, _p, _layout, _int, _p],
    "kvm_top_rows": [_p, _i64, _p, _i64, _p, _p],
    "kvm_gather_rows": [_p, _layout, _p, _i64, _p, _layout, _int],
    "kvm_scatter_rows": [_p, _layout, _p, _i64, _p, _layout, _int],
}


class Library:
    """The loaded library; `call(name, *args)` raises KernelError on a nonzero status."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._dll = ctypes.CDLL(str(self.path))
        self._dll.kvm_abi_version.restype = ctypes.c_int
        self._dll.kvm_error_string.restype = ctypes.c_char_p
        self._dll.kvm_error_string.argtypes = [ctypes.c_int]
        version = self._dll.kvm_abi_version()
        if version != ABI_VERSION:
            raise KernelError(f"{self.path} has ABI version {version}, expected {ABI_VERSION}")
        for name, argtypes in SIGNATURES.items():
            _declare(getattr(self._dll, name), argtypes + [_p])  # + the stream
            _declare(getattr(self._dll, name.replace("kvm_", "kvm_host_", 1)), argtypes)

    def call(self, name: str, *args: object) -> None:
        status = getattr(self._dll, name)(*args)
        if status != 0:
            message = self._dll.kvm_error_string(status).decode()
            raise KernelError(f"{name} failed with status {status}: {message}")


def _declare(function: CFuncPtr, argtypes: list[type[_CDataType]]) -> None:
    function.argtypes = argtypes
    function.restype = ctypes.c_int


def mode() -> str:
    value = os.environ.get("KVMOSAIC_KERNELS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise KernelError(f"KVMOSAIC_KERNELS={value!r}; use one of {', '.join(MODES)}")
    return value


_lock = threading.Lock()
_loaded: Library | None = None
_failure: str | None = None


def get() -> Library | None:
    """The library, or None where the twins must be used (mode off, or auto and it failed)."""
    current = mode()
    if current == "off":
        return None
    if _loaded is None and _failure is None:
        _load_once()
    if _loaded is None and current == "require":
        raise KernelError(
            f"KVMOSAIC_KERNELS=require but the kernel library is unavailable: {_failure}"
        )
    return _loaded


def load_from(path: Path) -> Library:
    """Load a specific library file (tests build into a temporary folder)."""
    return Library(path)


def reset() -> None:
    """Forget the load outcome, so the next `get` tries again (tests change the environment)."""
    global _loaded, _failure
    with _lock:
        _loaded, _failure = None, None


def _load_once() -> None:
    global _loaded, _failure
    with _lock:
        if _loaded is not None or _failure is not None:
            return
        try:
            prebuilt = os.environ.get("KVMOSAIC_KERNEL_LIBRARY")
            _loaded = Library(Path(prebuilt) if prebuilt else build.build())
            log.info("kernel library loaded from %s", _loaded.path)
        except (OSError, KvMosaicError) as exc:
            _failure = str(exc)
            if mode() == "auto":
                log.warning("CUDA kernels unavailable, using the PyTorch twins: %s", _failure)
