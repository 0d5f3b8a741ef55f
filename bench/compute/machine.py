"""What a compute benchmark prints first: which CPU and which of its kernels ran.

The bits and the speed of a bfloat16 product depend on whether the CPU has native bfloat16
dot products (AVX512-BF16, AMX-BF16) or oneDNN emulates them in float32, and on the code path
torch dispatches to (`torch.backends.cpu.get_cpu_capability()`), so a reader of a figure needs
both.
"""

from __future__ import annotations

import os
import platform

import torch

from engine.model.cpu import CPUINFO, cpu_has_amx_bf16, cpu_has_avx512_bf16, native_bfloat16


def cpu_model() -> str:
    """The CPU's model name and number (`/proc/cpuinfo`), e.g. "Intel Xeon ... (model 207)"."""
    try:
        lines = CPUINFO.read_text(errors="replace").splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    facts = dict(line.split(":", 1) for line in lines[:30] if ":" in line)
    facts = {key.strip(): value.strip() for key, value in facts.items()}
    return f"{facts.get('model name', 'unknown CPU')} (model {facts.get('model', '?')})"


def capability_lines() -> list[str]:
    """The lines that say which kernels a bfloat16 or float32 product ran on here."""
    bf16_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    native = native_bfloat16()
    return [
        f"cpu: {cpu_model()}, {len(os.sched_getaffinity(0))} usable CPUs, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads",
        f"flags: avx512_bf16={'yes' if cpu_has_avx512_bf16() else 'no'}, "
        f"amx_bf16={'yes' if cpu_has_amx_bf16() else 'no'}; "
        f"torch cpu capability {torch.backends.cpu.get_cpu_capability()}; "
        f"oneDNN {'on' if torch.backends.mkldnn.is_available() else 'off'}"  # type: ignore[no-untyped-call]
        + (f", its bfloat16 supported: {bool(bf16_supported())}" if bf16_supported else ""),
        f"bfloat16 dot products: {native or 'emulated (no AVX512-BF16, no AMX)'}",
    ]
