"""engine/model/native_step.py and its kernel (engine/cpu/decode_step.c): a whole decode step in
one call, equal to the twin (the model's own modules) to float32 rounding, every row bitwise
its lone step whatever its companions and the thread count, for each family's layer layout."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.cpu import library
from engine.kv import KVCache
from engine.model.decode import decode_batch, native_step, twin_batch
from engine.model.layers import DecoderStack
from engine.model.native_step import NativeDecodeStep, build_native_step, native_step_unfit
from engine.serving.threads import in_own_thread

CPU = torch.device("cpu")


def _supported() -> bool:
    lib = library.get() if library.find_compiler() is not None else None
    return lib is not None and lib.decode_step_supported


pytestmark = pytest.mark.skipif(not _supported(), reason="needs a C compiler and AVX-512F or AVX2")


def tiny_family(tokenizer, family: str, seed: int = 0):
    """A random tiny model of `family`'s layer layout: llama, qwen2 (q/k/v biases), qwen3
    (per-head q/k norms, head_dim apart from hidden / heads), wrapped as the engine loads it."""
    import transformers

    from engine.model.loader import wrap_model

    shapes = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=family != "qwen3",
    )
    if family == "qwen3":
        shapes["head_dim"] = 32
    kinds = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = kinds[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**shapes)).eval().requires_grad_(False)
    with torch.no_grad():  # sharper attention, and biases that matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(8)
                if proj.bias is not None:
                    proj.bias.normal_()
    return wrap_model(model, tokenizer)


def random_caches(spec, lengths, seed=0, spare=3, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    caches = []
    for length in lengths:
        cache = KVCache(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, length + spare, dtype, CPU
        )
        cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
        cache.length = length
        caches.append(cache)
    return caches


def clone(cache):
    copy = KVCache.__new__(KVCache)
    copy.data, copy.length = cache.data.clone(), cache.length
    return copy


def step(stack, caches, tokens, threads=2):
    return in_own_thread(lambda: decode_batch(stack, caches, tokens), threads=threads)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_stack(request, smol_tokenizer):
    loaded = tiny_family(smol_tokenizer, request.param)
    stack = DecoderStack(loaded, "native")
    assert stack.native_unfit is None
    return loaded, stack


def test_a_step_equals_the_twin_to_rounding_and_grows_the_caches_alike(family_stack):
    loaded, stack = family_stack
    lengths, tokens = [5, 300, 17, 600], [3, 40, 7, 100]
    caches = random_caches(loaded.spec, lengths)
    twin_caches = [clone(c) for c in caches]
    got = step(stack, caches, tokens)
    assert isinstance(stack.native, NativeDecodeStep)  # it ran the kernel
    expected = in_own_thread(lambda: twin_batch(stack, twin_caches, tokens))
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    for native, twin, length in zip(caches, twin_caches, lengths):
        assert native.length == twin.length == length + 1
        torch.testing.assert_close(native.data, twin.data, rtol=1e-5, atol=1e-5)
        assert torch.equal(native.data[:, :, :, :length], twin.data[:, :, :, :length])


def test_a_row_is_bitwise_its_lone_step_with_any_companions_and_thread_count(family_stack):
    loaded, stack = family_stack
    lengths = [300, 5, 17, 600, 33, 2, 260, 90, 11, 700]
    tokens = list(range(20, 20 + len(lengths)))
    caches = random_caches(loaded.spec, lengths, seed=1)
    alone = [
        step(stack, [clone(c)], [t], threads=threads)[0]
        for c, t, threads in zip(caches, tokens, [1, 2] * len(lengths))
    ]
    for size in (2, 3, 8, 10):  # 10 rows: a pass of 8 and one of 2
        batch = [clone(c) for c in caches[:size]]
        rows = step(stack, batch, tokens[:size])
        for i in range(size):
            assert torch.equal(rows[i], alone[i])


def test_the_twin_runs_where_the_step_cannot(smol_tokenizer):
    loaded = tiny_family(smol_tokenizer, "llama")
    stack = DecoderStack(loaded, "torch")
    assert stack.native_unfit is not None
    caches = random_caches(loaded.spec, [9])
    step(stack, caches, [4])
    assert stack.native is None and caches[0].length == 10


def test_a_model_the_kernel_does_not_run_is_named_with_the_reason(smol_tokenizer):
    loaded = tiny_family(smol_tokenizer, "llama")
    assert native_step_unfit(DecoderStack(loaded, "torch")) == "the decode attention is torch's"
    loaded.model.config.hidden_act = "gelu"
    assert "activation is gelu" in str(DecoderStack(loaded, "native").native_unfit)


def test_a_probe_that_disagrees_leaves_the_twin(smol_tokenizer):
    loaded = tiny_family(smol_tokenizer, "llama")
    stack = DecoderStack(loaded, "native")

    def wrong_twin(caches, tokens):
        return twin_batch(stack, caches, tokens) + 1.0

    assert in_own_thread(lambda: build_native_step(stack, "model", wrong_twin)) is None


def test_the_kernel_refuses_a_model_description_that_does_not_fit(family_stack):
    loaded, stack = family_stack
    native = in_own_thread(lambda: native_step(stack))
    assert native is not None
    broken = type(native.model).from_buffer_copy(native.model)
    broken.hidden = 48  # no longer the matrices' shape
    caches = random_caches(loaded.spec, [4])
    status = native.lib.decode_step(
        ctypes.byref(broken), 1, None, None, None, None, None, None, None, 1, None
    )
    assert status == 1 and caches[0].length == 4
