"""The AVX512-BF16 prefill attention kernel: as accurate as the flash kernel it replaces, and a
row's bits independent of the rows computed with it and of the thread count.

Runs where the kernel does (a CPU with AVX512-BF16 and no AMX, a C compiler); elsewhere only the
choice is checked.
"""

from __future__ import annotations

import pytest
import torch

from engine.cpu import library
from engine.errors import KvMosaicError
from engine.model import prefill_attention
from engine.model.attention import QueryLayout, _tiled_tail, causal_attention
from engine.model.cpu import cpu_has_amx_bf16, cpu_has_avx512_bf16

HEADS = [(14, 2), (9, 3)]  # Qwen2.5-Coder-0.5B's and SmolLM2-135M's (query, key) heads
SCALE = 0.125

runs_here = pytest.mark.skipif(
    not prefill_attention._cpu_allows(),
    reason="the kernel runs on a CPU with AVX512-BF16 and no AMX, with a C compiler",
)


def tensors(heads: int, kv_heads: int, n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(h, n, 64, generator=generator).bfloat16() for h in (heads, kv_heads, kv_heads)
    )


def test_it_runs_wherever_the_cpu_has_avx512_bf16_without_amx():
    """Not skipped silently: a CPU that can run it builds it (-march=native) and takes it."""
    if library.get() is None or not cpu_has_avx512_bf16() or cpu_has_amx_bf16():
        pytest.skip("not such a CPU, or no C compiler")
    cpu = torch.device("cpu")
    assert prefill_attention.kernel_for(torch.bfloat16, cpu) == "avx512-bf16"
    assert prefill_attention.kernel_for(torch.float32, cpu) == "flash"


def test_the_setting_keeps_flash_and_refuses_other_values(monkeypatch):
    for value, allowed in (("flash", False), ("fast", None)):
        monkeypatch.setenv(prefill_attention.ENV, value)
        prefill_attention._cpu_allows.cache_clear()
        try:
            if allowed is None:
                with pytest.raises(KvMosaicError, match="use one of auto, flash"):
                    prefill_attention._cpu_allows()
            else:
                assert prefill_attention._cpu_allows() is allowed
        finally:
            prefill_attention._cpu_allows.cache_clear()


def test_only_bfloat16_of_head_size_64_takes_it():
    q, k, _ = tensors(14, 2, 8)
    assert not prefill_attention.available(q.float(), k.float())
    assert not prefill_attention.available(q[..., :32], k[..., :32])


@runs_here
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_as_close_to_float32_attention_as_the_flash_kernel(heads, kv_heads):
    q, k, v = tensors(heads, kv_heads, 700)
    exact = _tiled_tail(q.float(), k.float(), v.float(), 0, SCALE)
    flash = (_tiled_tail(q, k, v, 0, SCALE).float() - exact).abs()
    mine = (prefill_attention.tail_attention(q, k, v, 0, SCALE).float() - exact).abs()
    assert mine.max() <= 2 * flash.max()
    assert mine.mean() <= 1.5 * flash.mean()


@runs_here
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_a_tail_s_rows_are_the_whole_prompt_s_bit_for_bit(heads, kv_heads):
    n = 300
    q, k, v = tensors(heads, kv_heads, n)
    whole = prefill_attention.tail_attention(q, k, v, 0, SCALE)
    for rows in (1, 2, 3, 5, 7, 31, 32, 33, 100, 299):
        tail = prefill_attention.tail_attention(q[:, n - rows :], k, v, n - rows, SCALE)
        assert torch.equal(tail, whole[:, n - rows :]), f"a tail of {rows} rows differs"


@runs_here
def test_the_thread_count_does_not_change_a_bit():
    q, k, v = tensors(14, 2, 260)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = prefill_attention.tail_attention(q, k, v, 0, SCALE)
        torch.set_num_threads(2)
        shared = prefill_attention.tail_attention(q, k, v, 0, SCALE)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)


@runs_here
def test_causal_attention_takes_it_for_a_bfloat16_tail():
    q, k, v = tensors(9, 3, 140)
    layout = QueryLayout(torch.arange(40, 140), 140, torch.bfloat16)
    out = causal_attention(q[:, 40:], k, v, layout, SCALE)
    mine = prefill_attention.tail_attention(q[:, 40:], k, v, 40, SCALE)
    assert torch.equal(out, mine.transpose(0, 1).reshape(100, -1))
