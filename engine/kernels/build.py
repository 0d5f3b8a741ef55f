"""Build the kernel library from `engine/csrc/*.cu` with nvcc, once per source version.

The library lands in `<cache>/<key>/libkvmosaic_kernels.so`, where key hashes the sources,
the nvcc version and the flags, so a change of any of them builds anew and an unchanged one
is reused. The file is written under a temporary name and renamed into place, so processes
building at the same time never see a half-written library.

No torch CUDA extension machinery is used: the library has a plain C ABI (`csrc/kvmosaic.h`)
and nvcc is the only tool needed. Run `python -m engine.kernels` to build ahead of use.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.errors import KvMosaicError

SOURCE_DIR = Path(__file__).resolve().parents[1] / "csrc"
LIBRARY_NAME = "libkvmosaic_kernels.so"
DEFAULT_ARCH = "90"  # Hopper (H100/H200); PTX is embedded too, so newer GPUs JIT it
COMPILE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-Xcompiler",
    "-fPIC",
    "-Xcompiler",
    "-ffp-contract=off",
    "-lineinfo",
)


class KernelBuildError(KvMosaicError):
    """nvcc is missing or failed; the message carries its output."""


def find_nvcc() -> Path | None:
    """`KVMOSAIC_NVCC`, `$CUDA_HOME/bin/nvcc`, nvcc on PATH, or /usr/local/cuda/bin/nvcc."""
    candidates = [os.environ.get("KVMOSAIC_NVCC")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def nvcc_version(nvcc: Path) -> str:
    """The last line of `nvcc --version` (e.g. "Build cuda_13.0.r13.0/compiler.36424714_0")."""
    result = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else "unknown"


def default_arch() -> str:
    """`KVMOSAIC_CUDA_ARCH` (e.g. "90"), else the current GPU's compute capability, else 90."""
    if os.environ.get("KVMOSAIC_CUDA_ARCH"):
        return os.environ["KVMOSAIC_CUDA_ARCH"]
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}{minor}"
    except Exception:  # no torch, or a broken driver: build for the default
        pass
    return DEFAULT_ARCH


def arch_flags(arch: str) -> list[str]:
    """Machine code for `arch` plus its PTX, so later GPUs can still load the library."""
    return [
        "-gencode",
        f"arch=compute_{arch},code=sm_{arch}",
        "-gencode",
        f"arch=compute_{arch},code=compute_{arch}",
    ]


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cu"))


def build_key(nvcc: Path, arch: str) -> str:
    """Hash of every source and header, the nvcc version and the flags; 16 hex digits."""
    digest = hashlib.sha256()
    for path in (
        sorted(SOURCE_DIR.glob("*.cu"))
        + sorted(SOURCE_DIR.glob("*.h"))
        + sorted(SOURCE_DIR.glob("*.cuh"))
    ):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(nvcc_version(nvcc).encode())
    digest.update(" ".join(COMPILE_FLAGS + tuple(arch_flags(arch))).encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """`KVMOSAIC_KERNEL_CACHE`, else `$XDG_CACHE_HOME/kvmosaic/kernels` (~/.cache by default)."""
    if os.environ.get("KVMOSAIC_KERNEL_CACHE"):
        return Path(os.environ["KVMOSAIC_KERNEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvmosaic" / "kernels"


def compile_objects(
    out_dir: Path, arch: str = DEFAULT_ARCH, nvcc: Path | None = None, jobs: int | None = None
) -> list[Path]:
    """Compile every `.cu` to `out_dir/<name>.o`, in parallel; raises KernelBuildError."""
    nvcc = nvcc or _require_nvcc()
    out_dir.mkdir(parents=True, exist_ok=True)
    files = sources()

    def compile_one(source: Path) -> Path:
        target = out_dir / (source.stem + ".o")
        _run(
            [
                str(nvcc),
                *COMPILE_FLAGS,
                *arch_flags(arch),
                "-I",
                str(SOURCE_DIR),
                "-c",
                str(source),
                "-o",
                str(target),
            ]
        )
        return target

    with ThreadPoolExecutor(max_workers=jobs or min(len(files), os.cpu_count() or 1)) as pool:
        return list(pool.map(compile_one, files))


def link_library(objects: list[Path], target: Path, nvcc: Path | None = None) -> Path:
    """Link objects into a shared library with the CUDA runtime linked in statically."""
    nvcc = nvcc or _require_nvcc()
    _run([str(nvcc), "-shared", "-cudart", "static", *map(str, objects), "-o", str(target)])
    return target


def build(
    arch: str | None = None,
    cache_dir: Path | None = None,
    nvcc: Path | None = None,
    force: bool = False,
) -> Path:
    """Path of the built library, building it first unless an identical build is cached."""
    nvcc = nvcc or _require_nvcc()
    arch = arch or default_arch()
    folder = (cache_dir or cache_root()) / build_key(nvcc, arch)
    target = folder / LIBRARY_NAME
    if target.is_file() and not force:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as work:
        staged = link_library(
            compile_objects(Path(work), arch, nvcc), Path(work) / LIBRARY_NAME, nvcc
        )
        os.replace(staged, target)  # atomic on one file system
    return target


def _require_nvcc() -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelBuildError(
            "nvcc not found (set KVMOSAIC_NVCC or CUDA_HOME, or put nvcc on PATH)"
        )
    return nvcc


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the kvmosaic kernel library")
    parser.add_argument("--arch", default=None, help="compute capability without the dot, e.g. 90")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    print(build(args.arch, args.cache_dir, force=args.force))
    return 0
