"""Which bfloat16 a CPU has natively, and what `dtype=auto` takes on each (and says why)."""

from __future__ import annotations

import torch

from engine.model.loader import (
    auto_dtype_reason,
    cpu_has_avx512_bf16,
    native_bfloat16,
    resolve_dtype,
)


def cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor : 0\nvendor_id : AuthenticAMD\nflags : fpu avx512f {flags}\n")
    return path


def test_native_bfloat16_is_amx_then_avx512_bf16_else_emulated(tmp_path):
    assert native_bfloat16(cpuinfo(tmp_path, "avx512_bf16 amx_bf16 amx_tile")) == "AMX-BF16"
    assert native_bfloat16(cpuinfo(tmp_path, "avx512_bf16")) == "AVX512-BF16"
    assert native_bfloat16(cpuinfo(tmp_path, "avx512_vnni")) is None
    assert native_bfloat16(tmp_path / "absent") is None
    assert cpu_has_avx512_bf16.__wrapped__(cpuinfo(tmp_path, "avx512_bf16"))
    assert not cpu_has_avx512_bf16.__wrapped__(cpuinfo(tmp_path, "avx512bw"))


def test_auto_stays_float32_on_avx512_bf16_as_its_rule_decided(tmp_path):
    """docs/benchmarks/bfloat16.md, "auto on AVX512-BF16": run on an AMD EPYC (Zen 4), the rule
    kept float32 (bfloat16 prefill short of the speed-up it asks)."""
    assert resolve_dtype("auto", "cpu", amx=False) == torch.float32
    reason = auto_dtype_reason("cpu", cpuinfo(tmp_path, "avx512_bf16"))
    assert reason.startswith("float32") and "AVX512-BF16" in reason and "bfloat16" in reason


def test_the_reason_names_what_auto_chose(tmp_path):
    assert auto_dtype_reason("cpu", cpuinfo(tmp_path, "amx_bf16")).startswith("bfloat16")
    assert auto_dtype_reason("cpu", cpuinfo(tmp_path, "avx2")).startswith("float32")
    assert auto_dtype_reason("cuda:0").startswith("float16")
