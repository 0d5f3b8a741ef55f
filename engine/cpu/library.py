"""Build the CPU kernel library from `engine/cpu/*.c` (and the header they share) with the C
compiler, and load it.

The library is compiled on the machine that runs it, for that machine (`-march=native`), and
cached in `<kernel cache>/cpu-<key>/libkvmosaic_cpu.so` (the CUDA kernels' cache root,
`engine.kernels.build.cache_root`), where key hashes the sources, the compiler's version, the
flags and this CPU's model and feature flags: another machine sharing the cache (a network
home, a container image) builds its own. It is written under a temporary name and renamed into
place, so processes building at the same time never see a half-written library. A build takes
tens of seconds with gcc (docs/benchmarks/decode.md), once per machine and source.

It links OpenMP by soname (`libgomp.so.1`); torch has already loaded its own copy under that
name, so the kernels run on the same runtime and thread pools as torch's operations.

`get()` builds and loads once per process and keeps the outcome; None (with one warning) where
there is no compiler or the build fails, and the callers use their PyTorch twins.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from engine.errors import KvMosaicError
from engine.kernels.build import cache_root

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
LIBRARY_NAME = "libkvmosaic_cpu.so"
ABI_VERSION = 4  # KVM_CPU_ABI_VERSION in kernels.h
# fp-contract=fast lets the compiler fuse multiply-adds: the results are fixed by the binary
# (the same on every call, whatever the batch), which is all the engine needs of them.
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=gnu11",
)

_i64p = ctypes.c_void_p
SIGNATURES = {
    "kvm_cpu_decode_attention": [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        _i64p,
        _i64p,
        _i64p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ],
    "kvm_cpu_decode_step": [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        _i64p,
        _i64p,
        _i64p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ],
    "kvm_cpu_decode_step_supported": [],
    "kvm_cpu_prefill_attention": [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
    ],
    "kvm_cpu_prefill_attention_supported": [],
}
CACHE_DTYPES = {"float32": 0, "bfloat16": 1}  # the last argument of kvm_cpu_decode_attention
ERRORS = {1: "unsupported shape", 2: "out of memory", 3: "unsupported by this CPU's build"}


class CpuKernelError(KvMosaicError):
    """The C compiler is missing or failed, or a kernel call returned an error."""


def find_compiler() -> Path | None:
    """`$CC`, else cc or gcc on PATH."""
    for candidate in (os.environ.get("CC"), shutil.which("cc"), shutil.which("gcc")):
        if candidate and shutil.which(candidate):
            return Path(shutil.which(candidate) or candidate)
    return None


def cpu_signature() -> str:
    """This CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [
        line
        for line in text.splitlines()
        if line.split(":")[0].strip() in ("model name", "flags", "Features")
    ]
    return "\n".join(dict.fromkeys(wanted))  # the first CPU's lines (all CPUs of a machine agree)


def build_key(compiler: Path) -> str:
    version = subprocess.run(
        [str(compiler), "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256()
    for path in sorted([*SOURCE_DIR.glob("*.c"), *SOURCE_DIR.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    for part in (version.splitlines()[:1], COMPILE_FLAGS, [cpu_signature()]):
        digest.update("\n".join(part).encode())
    return digest.hexdigest()[:16]


def build(cache_dir: Path | None = None, force: bool = False) -> Path:
    """Path of the built library, building it unless an identical build is cached."""
    compiler = find_compiler()
    if compiler is None:
        raise CpuKernelError("no C compiler found (set CC, or install gcc)")
    folder = (cache_dir or cache_root()) / f"cpu-{build_key(compiler)}"
    target = folder / LIBRARY_NAME
    if target.is_file() and not force:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as work:
        staged = Path(work) / LIBRARY_NAME
        command = [
            str(compiler),
            *COMPILE_FLAGS,
            *map(str, sorted(SOURCE_DIR.glob("*.c"))),
            "-o",
            str(staged),
            "-lm",
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise CpuKernelError(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")
        os.replace(staged, target)  # atomic on one file system
    return target


class CpuLibrary:
    """The loaded library; `call(name, *args)` raises CpuKernelError on a nonzero status."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._dll = ctypes.CDLL(str(self.path))
        self._dll.kvm_cpu_abi_version.restype = ctypes.c_int
        version = self._dll.kvm_cpu_abi_version()
        if version != ABI_VERSION:
            raise CpuKernelError(f"{self.path} has ABI version {version}, expected {ABI_VERSION}")
        for name, argtypes in SIGNATURES.items():
            function = getattr(self._dll, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        self.decode_attention = self._dll.kvm_cpu_decode_attention
        self.decode_step = self._dll.kvm_cpu_decode_step
        self.decode_step_supported = bool(self._dll.kvm_cpu_decode_step_supported())
        self.prefill_attention = self._dll.kvm_cpu_prefill_attention
        self.prefill_attention_supported = bool(self._dll.kvm_cpu_prefill_attention_supported())

    def check(self, name: str, status: int) -> None:
        if status != 0:
            raise CpuKernelError(
                f"{name} failed with status {status}: {ERRORS.get(status, 'unknown error')}"
            )


_lock = threading.Lock()
_outcome: CpuLibrary | str | None = None  # the library, or why it could not be had


def get() -> CpuLibrary | None:
    """The library, built and loaded on first use; None if that failed (logged once)."""
    global _outcome
    with _lock:
        if _outcome is None:
            try:
                _outcome = CpuLibrary(build())
                log.info("CPU kernel library loaded from %s", _outcome.path)
            except (OSError, KvMosaicError) as error:
                _outcome = str(error)
                log.warning("CPU kernels unavailable, using the PyTorch twins: %s", error)
        return _outcome if isinstance(_outcome, CpuLibrary) else None


def failure() -> str | None:
    """Why `get()` returned None, once it has; else None."""
    return _outcome if isinstance(_outcome, str) else None
