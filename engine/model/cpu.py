"""What the CPU is, as far as the engine's arithmetic cares: its bfloat16 instructions, and
the identity of the kernels that compute a product's last bits (`arithmetic_of`)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")


def _cpu_flags(cpuinfo: Path) -> frozenset[str]:
    """The flags the first `flags` line of `cpuinfo` lists (empty where the file is absent)."""
    return frozenset(_cpu_field(cpuinfo, "flags").split())


@functools.cache
def cpu_has_amx_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """True when the CPU flags list `amx_bf16` (Linux; False where /proc/cpuinfo is absent)."""
    return "amx_bf16" in _cpu_flags(cpuinfo)


@functools.cache
def cpu_has_avx512_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """True when the CPU flags list `avx512_bf16` (native bfloat16 dot products in AVX-512,
    e.g. AMD Zen 4, Intel Cooper Lake and later; False where /proc/cpuinfo is absent)."""
    return "avx512_bf16" in _cpu_flags(cpuinfo)


def native_bfloat16(cpuinfo: Path = CPUINFO) -> str | None:
    """Which instructions give this CPU native bfloat16 products: "AMX-BF16", "AVX512-BF16", or
    None where bfloat16 is emulated (converted to float32 and back)."""
    flags = _cpu_flags(cpuinfo)
    if "amx_bf16" in flags:
        return "AMX-BF16"
    return "AVX512-BF16" if "avx512_bf16" in flags else None


def _cpu_field(cpuinfo: Path, name: str) -> str:
    """The first `name` field of `cpuinfo` ("" where the file or the field is absent)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() == name), "")
    return line.partition(":")[2].strip()


@functools.cache
def arithmetic_of(device: str, cpuinfo: Path = CPUINFO) -> str:
    """Which kernels compute a product here: torch's version and, on the CPU, the vendor, the
    instruction set torch dispatches to and the native bfloat16 instructions; on CUDA, the
    GPU's compute capability. Machines that differ in these compute other bits; ones that
    agree are taken to compute the same (microarchitectures of one instruction set are not
    told apart).

    Why in the fingerprint: MKL, oneDNN and torch's own kernels pick their code by these, and
    another code path gives a product other last bits, so KV from a replica on another CPU
    is not full prefill's here.
    """
    parts = [f"torch {torch.__version__}"]
    if device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        parts.append(f"sm {major}.{minor}")
    else:
        parts.append(_cpu_field(cpuinfo, "vendor_id") or "unknown vendor")
        parts.append(torch.backends.cpu.get_cpu_capability())
        parts.append(native_bfloat16(cpuinfo) or "bfloat16 emulated")
    return ", ".join(parts)
