"""engine/model/decode_attention.py and its C kernel (engine/cpu/): the same attention as the
PyTorch
twin to float32 rounding, a row's bits independent of its companions and of the thread count,
clear refusals, and a build that caches and fails cleanly."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.cpu import library
from engine.kv import KVCache
from engine.model.decode import decode_batch
from engine.model.decode_attention import (
    NativeStepAttention,
    TorchStepAttention,
    resolve_decode_attention,
    step_attention,
)
from engine.model.layers import DecoderStack
from engine.planners import Mode
from engine.serving.threads import in_own_thread, use_threads
from tests.engine.helpers import QUESTION, chunk_inputs

pytestmark = pytest.mark.skipif(library.find_compiler() is None, reason="needs a C compiler")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lib():
    built = library.get()
    assert built is not None, library.failure()
    return built


def caches_of(lengths, kv_heads, head_dim, layers=2, seed=0, spare=5, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    caches = []
    for length in lengths:
        cache = KVCache(layers, kv_heads, head_dim, length + spare, dtype, CPU)
        cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
        cache.length = length
        caches.append(cache)
    return caches


def queries(heads, rows, head_dim, seed=1):
    return torch.randn(heads, rows, head_dim, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (16, 2)])
def test_the_kernel_matches_the_twin(lib, head_dim, heads, kv_heads):
    # one key, a ragged tail under 16, exactly one block, one key past it, several blocks
    lengths = [1, 15, 16, 17, 256, 257, 1000]
    caches = caches_of(lengths, kv_heads, head_dim)
    positions = [n - 1 for n in lengths]
    q = queries(heads, len(lengths), head_dim)
    for layer in (0, 1):
        got = NativeStepAttention(lib, caches, positions, head_dim**-0.5)(layer, q)
        expected = TorchStepAttention(caches, positions, head_dim**-0.5)(layer, q)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (16, 2)])
def test_the_kernel_reads_bfloat16_caches_as_their_float32_values(lib, head_dim, heads, kv_heads):
    """bfloat16 caches give what the twin gives on the same values widened to float32, to float32
    rounding; bfloat16 queries give a bfloat16 output, that result rounded."""
    lengths = [1, 15, 17, 257, 1000]
    caches = caches_of(lengths, kv_heads, head_dim, dtype=torch.bfloat16)
    widened = caches_of(lengths, kv_heads, head_dim)
    for narrow, wide in zip(caches, widened):
        wide.data.copy_(narrow.data)
    positions = [n - 1 for n in lengths]
    q = queries(heads, len(lengths), head_dim).bfloat16()
    attention = NativeStepAttention(lib, caches, positions, head_dim**-0.5)
    for layer in (0, 1):
        got = attention(layer, q.float())
        expected = TorchStepAttention(widened, positions, head_dim**-0.5)(layer, q.float())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        rounded = attention(layer, q)
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())


def test_a_row_is_bitwise_the_same_alone_with_any_companions_and_any_thread_count(lib):
    lengths = [700, 40, 1300, 3]
    caches = caches_of(lengths, 3, 64)
    positions = [n - 1 for n in lengths]
    q = queries(9, len(lengths), 64)
    together = NativeStepAttention(lib, caches, positions, 0.125)(1, q)
    for i in range(len(lengths)):
        alone = NativeStepAttention(lib, caches[i : i + 1], positions[i : i + 1], 0.125)(
            1, q[:, i : i + 1].contiguous()
        )
        assert torch.equal(alone[0], together[i])

    def on_one_thread():
        use_threads(1)
        return NativeStepAttention(lib, caches, positions, 0.125)(1, q)

    assert torch.equal(in_own_thread(on_one_thread), together)


def test_padding_rows_get_zeros_and_a_strided_query_is_read_right(lib):
    lengths = [50, 90]
    caches = caches_of(lengths, 2, 32)
    positions = [n - 1 for n in lengths]
    q = queries(4, 3, 32)  # one padding row
    # rows outermost: q.stride(1) > q.stride(0)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    got = NativeStepAttention(lib, caches, positions, 0.2)(0, strided)
    assert not got[2].any()
    torch.testing.assert_close(
        got, TorchStepAttention(caches, positions, 0.2)(0, q), rtol=1e-5, atol=1e-5
    )


def test_an_unsupported_shape_or_cache_dtype_is_refused_without_writing(lib):
    def call(cache, head_dim, cache_dtype):
        out = torch.full((1, 2, head_dim), 7.0)
        q = queries(2, 1, head_dim)
        meta = torch.tensor([[cache.data.data_ptr()], [cache.capacity], [10]], dtype=torch.int64)
        status = lib.decode_attention(
            1,
            ctypes.c_void_p(q.data_ptr()),
            q.stride(0),
            q.stride(1),
            ctypes.c_void_p(meta[0].data_ptr()),
            ctypes.c_void_p(meta[1].data_ptr()),
            ctypes.c_void_p(meta[2].data_ptr()),
            0,
            1,
            2,
            head_dim,
            0.1,
            ctypes.c_void_p(out.data_ptr()),
            1,
            cache_dtype,
        )
        with pytest.raises(library.CpuKernelError, match="unsupported shape"):
            lib.check("kvm_cpu_decode_attention", status)
        assert torch.equal(out, torch.full((1, 2, head_dim), 7.0))

    # head_dim 48: not compiled
    call(caches_of([10], 1, 48)[0], 48, library.CACHE_DTYPES["float32"])
    call(caches_of([10], 1, 16)[0], 16, 2)  # no such cache dtype


def test_queries_or_caches_that_do_not_fit_are_refused(lib):
    caches = caches_of([10, 12], 1, 16)
    attention = NativeStepAttention(lib, caches, [9, 11], 0.25)
    with pytest.raises(ValueError, match="do not fit"):
        attention(0, queries(2, 1, 16))  # fewer rows than requests
    with pytest.raises(ValueError, match="do not fit"):
        attention(0, queries(2, 2, 16).double())
    half = KVCache(2, 1, 16, 12, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        NativeStepAttention(lib, [caches[0], half], [9, 3], 0.25)  # mixed
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        NativeStepAttention(lib, [KVCache(2, 1, 16, 12, torch.float16, CPU)], [3], 0.25)
    with pytest.raises(ValueError, match="do not fit"):
        NativeStepAttention(lib, [half], [3], 0.25)(0, queries(2, 1, 16).half())


def test_resolution_picks_native_where_it_applies_and_explains_where_not(lib):
    assert resolve_decode_attention("auto", CPU, torch.float32, 9, 3, 64) == "native"
    assert resolve_decode_attention("native", CPU, torch.float32, 4, 2, 16) == "native"
    assert resolve_decode_attention("torch", CPU, torch.float32, 9, 3, 64) == "torch"
    assert resolve_decode_attention("auto", CPU, torch.bfloat16, 9, 3, 64) == "native"
    assert resolve_decode_attention("auto", CPU, torch.float16, 9, 3, 64) == "torch"
    assert resolve_decode_attention("auto", CPU, torch.float32, 9, 3, 48) == "torch"
    assert (
        resolve_decode_attention("auto", torch.device("cuda"), torch.float32, 9, 3, 64) == "torch"
    )
    with pytest.raises(ValueError, match="float32 and bfloat16 on the CPU"):
        resolve_decode_attention("native", CPU, torch.float16, 9, 3, 64)
    with pytest.raises(ValueError, match="head_dim 48"):
        resolve_decode_attention("native", CPU, torch.float32, 9, 3, 48)
    with pytest.raises(ValueError, match="unknown decode attention"):
        resolve_decode_attention("fast", CPU, torch.float32, 9, 3, 64)


def test_the_build_is_cached_and_a_broken_compiler_is_a_clear_error(tmp_path, monkeypatch):
    first = library.build(cache_dir=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert library.build(cache_dir=tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert library.CpuLibrary(first).path == first
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with pytest.raises(library.CpuKernelError, match="failed"):
        library.build(cache_dir=tmp_path / "other")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC")
    with pytest.raises(library.CpuKernelError, match="no C compiler"):
        library.build(cache_dir=tmp_path / "third")
    leftovers = [
        path.name
        for path in (tmp_path / "other").rglob("*")
        if path.is_file() or ".build-" in path.name
    ]
    assert leftovers == []  # nothing half-built left behind


def test_decode_steps_of_the_tiny_model_agree_on_both_attentions(tiny_engine, tiny_loaded):
    """Whole decode steps (tiny model, head_dim 16) on the kernel and on the twin: same logits
    to rounding, the same greedy tokens, step after step."""
    chunks = chunk_inputs(tiny_engine)
    prefilled = [
        tiny_engine.prefill(chunks[i:], QUESTION, mode=Mode.named("full"), max_new_tokens=8)
        for i in range(3)
    ]
    stacks = {kind: DecoderStack(tiny_loaded, kind) for kind in ("native", "torch")}
    runs = {}
    for kind, stack in stacks.items():
        caches = [clone(result.cache) for result in prefilled]
        tokens = [int(result.logits.argmax()) for result in prefilled]
        steps = []
        for _ in range(4):
            logits = in_own_thread(lambda: decode_batch(stack, caches, tokens))  # noqa: B023 (run at once)
            steps.append(logits)
            tokens = [int(row.argmax()) for row in logits]
        runs[kind] = steps
    for native, twin in zip(runs["native"], runs["torch"]):
        torch.testing.assert_close(native, twin, rtol=1e-4, atol=1e-4)
        assert torch.equal(native.argmax(-1), twin.argmax(-1))


def test_step_attention_follows_the_stack_choice(lib):
    caches = caches_of([5], 1, 16)
    assert isinstance(step_attention("native", caches, [4], 0.25), NativeStepAttention)
    assert isinstance(step_attention("torch", caches, [4], 0.25), TorchStepAttention)


def clone(cache):
    copy = type(cache).__new__(type(cache))
    copy.data, copy.length = cache.data.clone(), cache.length
    return copy


def test_bfloat16_decode_steps_run_on_the_kernel_and_agree_with_the_twin(smol_tokenizer):
    """A bfloat16 model (tiny, head_dim 16) decodes through the kernel with bfloat16 caches:
    logits close to the twin's (the native step computes in float32 from the bfloat16 weights,
    the twin in bfloat16), caches grown alike to bfloat16 rounding, and each row the same alone
    as in the batch."""
    from engine.model.loader import wrap_model
    from tests.conftest import build_tiny_model

    loaded = wrap_model(build_tiny_model(len(smol_tokenizer)).to(torch.bfloat16), smol_tokenizer)
    spec = loaded.spec
    assert (
        resolve_decode_attention(
            "auto", CPU, torch.bfloat16, spec.num_heads, spec.num_kv_heads, spec.head_dim
        )
        == "native"
    )
    lengths, tokens = [40, 300, 7], [5, 17, 99]
    logits, grown = {}, {}
    for kind in ("native", "torch"):
        caches = caches_of(
            lengths, spec.num_kv_heads, spec.head_dim, layers=spec.num_layers, dtype=torch.bfloat16
        )
        logits[kind] = in_own_thread(
            lambda: decode_batch(DecoderStack(loaded, kind), caches, tokens, invariant=True)  # noqa: B023
        )
        grown[kind] = caches
    assert logits["native"].dtype == torch.float32 and logits["native"].shape == (
        3,
        len(smol_tokenizer),
    )
    torch.testing.assert_close(logits["native"], logits["torch"], rtol=0.05, atol=0.05)
    for native, twin, length in zip(grown["native"], grown["torch"], lengths):
        assert native.length == twin.length == length + 1
        # layer 0's new K/V comes before any attention: rounded once (native) or at every
        # operation (the twin's bfloat16 arithmetic)
        torch.testing.assert_close(
            native.data[0].float(), twin.data[0].float(), rtol=2**-6, atol=2**-6
        )
        # the old rows untouched
        assert torch.equal(native.data[:, :, :, :length], twin.data[:, :, :, :length])
    batch = caches_of(
        lengths, spec.num_kv_heads, spec.head_dim, layers=spec.num_layers, dtype=torch.bfloat16
    )
    alone = [clone(batch[1])]  # the batch's second request, before its step
    row = in_own_thread(
        lambda: decode_batch(DecoderStack(loaded, "native"), alone, tokens[1:2], invariant=True)
    )
    assert torch.equal(row[0], logits["native"][1])
