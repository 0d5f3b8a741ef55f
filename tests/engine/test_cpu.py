"""engine/model/cpu.py: the machine's arithmetic names what picks a product's kernels, and the
model fingerprint follows it (KV from a replica on another CPU is not reused as exact)."""

from __future__ import annotations

import pytest
import torch

import engine.model.loader as loader
from engine.model.cpu import arithmetic_of
from tests.conftest import build_tiny_model


def cpuinfo(tmp_path, name: str, vendor: str, flags: str):
    path = tmp_path / name
    path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx512f {flags}\n")
    return path


def test_the_arithmetic_names_torch_the_vendor_and_the_bfloat16_instructions(tmp_path):
    zen4 = arithmetic_of.__wrapped__("cpu", cpuinfo(tmp_path, "a", "AuthenticAMD", "avx512_bf16"))
    assert zen4.startswith(f"torch {torch.__version__}, AuthenticAMD, ")
    assert zen4.endswith(", AVX512-BF16")
    xeon = arithmetic_of.__wrapped__("cpu", cpuinfo(tmp_path, "b", "GenuineIntel", "amx_bf16"))
    assert xeon.endswith(", AMX-BF16") and "GenuineIntel" in xeon
    same = arithmetic_of.__wrapped__("cpu", cpuinfo(tmp_path, "c", "AuthenticAMD", "avx512_bf16"))
    assert same == zen4
    older = arithmetic_of.__wrapped__("cpu", cpuinfo(tmp_path, "d", "AuthenticAMD", ""))
    assert older.endswith(", bfloat16 emulated") and older != zen4
    assert "unknown vendor" in arithmetic_of.__wrapped__("cpu", tmp_path / "absent")


def test_another_machines_arithmetic_is_another_fingerprint(smol_tokenizer, monkeypatch):
    model = build_tiny_model(len(smol_tokenizer))
    here = loader.model_fingerprint(model, smol_tokenizer, torch.float32)
    assert loader.model_fingerprint(model, smol_tokenizer, torch.float32) == here
    monkeypatch.setattr(loader, "arithmetic_of", lambda device: "torch 0, OtherVendor, AVX2")
    assert loader.model_fingerprint(model, smol_tokenizer, torch.float32) != here


def test_the_native_decode_step_builds_wherever_the_cpu_has_its_vectors():
    """AVX-512F, or AVX2 with FMA and F16C (vec16.h): on such a CPU the step must not fall back
    to the PyTorch twin, which is several times slower per token."""
    from engine.cpu import library
    from engine.model.cpu import CPUINFO, _cpu_flags

    lib = library.get()
    if lib is None:
        pytest.skip("no C compiler")
    flags = _cpu_flags(CPUINFO)
    vectors = "avx512f" in flags or {"avx2", "fma", "f16c"} <= flags
    assert lib.decode_step_supported == vectors
