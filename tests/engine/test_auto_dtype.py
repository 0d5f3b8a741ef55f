"""Which bfloat16 a CPU has natively, and what `dtype=auto` takes on each (and says why)."""

from __future__ import annotations

import dataclasses

import torch

from engine.model.cpu import cpu_has_avx512_bf16, native_bfloat16
from engine.model.known import QWEN_CODER
from engine.model.loader import auto_dtype_reason, resolve_dtype


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


def test_on_avx512_bf16_auto_is_bfloat16_only_for_a_model_whose_rule_passed(tmp_path):
    """docs/benchmarks/bfloat16.md, "auto on AVX512-BF16, run": decided per known model."""
    passed = dataclasses.replace(QWEN_CODER, bfloat16_on_avx512_bf16=True)
    not_run = dataclasses.replace(QWEN_CODER, bfloat16_on_avx512_bf16=False)
    native = {"amx": False, "avx512_bf16": True}
    assert resolve_dtype("auto", "cpu", known=passed, **native) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", known=not_run, **native) == torch.float32
    assert resolve_dtype("auto", "cpu", known=None, **native) == torch.float32  # by path
    emulated = {"amx": False, "avx512_bf16": False}
    assert resolve_dtype("auto", "cpu", known=passed, **emulated) == torch.float32
    assert resolve_dtype("float32", "cpu", known=passed, **native) == torch.float32
    flags = cpuinfo(tmp_path, "avx512_bf16")
    assert auto_dtype_reason("cpu", flags, passed).startswith("bfloat16")
    for known in (not_run, None):
        reason = auto_dtype_reason("cpu", flags, known)
        assert reason.startswith("float32") and "AVX512-BF16" in reason and "bfloat16" in reason


def test_the_reason_names_what_auto_chose(tmp_path):
    assert auto_dtype_reason("cpu", cpuinfo(tmp_path, "amx_bf16")).startswith("bfloat16")
    assert auto_dtype_reason("cpu", cpuinfo(tmp_path, "avx2")).startswith("float32")
    assert auto_dtype_reason("cuda:0").startswith("float16")


def test_auto_takes_bfloat16_on_avx512_bf16_for_the_models_whose_rule_passed():
    """bfloat16.md, "auto on AVX512-BF16, run": SmolLM2 and Qwen2.5-Coder-0.5B passed; the
    1.5B was not run, so it stays float32 there."""
    from engine.model.known import QWEN_CODER_15B, SMOLLM2

    native = {"amx": False, "avx512_bf16": True}
    for passed in (SMOLLM2, QWEN_CODER):
        assert resolve_dtype("auto", "cpu", known=passed, **native) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", known=QWEN_CODER_15B, **native) == torch.float32
