"""Engine.summary and Engine.dtype_hint: what the server prints when it is ready."""

from __future__ import annotations

import engine.engine as engine_module


def test_the_summary_names_dtype_device_kernels_and_threads(tiny_engine):
    summary = tiny_engine.summary
    assert summary.startswith("float32 on cpu, linear kernel ")
    assert "prefill attention flash" in summary  # a float32 model keeps the flash kernel
    assert f"decode attention {tiny_engine.stack.decode_attention}, " in summary
    assert f", {tiny_engine.threads} thread" in summary
    assert summary.endswith((", prefill rows in tiles of 128, padded", ", unpadded"))


def test_the_bfloat16_hint_appears_on_a_float32_cpu_engine_with_amx_only(tiny_engine, monkeypatch):
    monkeypatch.setattr(engine_module, "cpu_has_amx_bf16", lambda: True)
    assert "KVMOSAIC_DTYPE=auto (bfloat16)" in (tiny_engine.dtype_hint or "")
    monkeypatch.setattr(engine_module, "cpu_has_amx_bf16", lambda: False)
    assert tiny_engine.dtype_hint is None
