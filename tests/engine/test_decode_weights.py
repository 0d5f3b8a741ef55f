"""engine/model/decode_weights.py: the formats the native decode step reads. Weights that came
from GGUF blocks come back code for code (so the decode is bitwise the float32 model's); other
weights are rounded to their block's grid; every format decodes like the model's own weights."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv import KVCache
from engine.model.decode import decode_batch
from engine.model.decode_weights import BLOCK, formats_for, pack
from engine.model.layers import DecoderStack
from engine.serving.threads import in_own_thread
from tests.engine.test_native_step import _supported, clone, random_caches, tiny_family

CPU = torch.device("cpu")


def _half(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def gguf_blocks(rows: int, cols: int, kind: str, seed: int = 0) -> torch.Tensor:
    """Float32 weights as GGUF's dequantization makes them from random blocks of `kind`:
    Q8_0 (d * q), Q4_0 (d * (q - 8)), Q4_1 (d * q + m), d and m float16, in float32 steps."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols // BLOCK, BLOCK, generator=generator) * 0.05
    if kind == "q8_0":
        d = _half(x.abs().amax(-1) / 127)
        q = torch.round(x / d[..., None]).clamp(-127, 127)
        w = d[..., None] * q
    elif kind == "q4_0":
        signed = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))[..., 0]
        d = _half(signed / -8)
        q = torch.round(x / d[..., None] + 8.5 - 0.5).clamp(0, 15)
        w = d[..., None] * (q - 8)
    else:
        low, high = x.amin(-1), x.amax(-1)
        d, m = _half((high - low) / 15), _half(low)
        q = torch.round((x - low[..., None]) / d[..., None]).clamp(0, 15)
        w = d[..., None] * q + m[..., None]
    return w.reshape(rows, cols)


@pytest.mark.parametrize(
    ("kind", "format"),
    [("q8_0", "int8"), ("q4_0", "int8"), ("q4_1", "int8"), ("q4_1", "int4")],
)
def test_gguf_blocks_come_back_code_for_code(kind, format):
    weights = gguf_blocks(48, 96, kind)
    packed = pack(weights, format, rows_at_once=20)  # several row slices
    assert packed.exact == 1.0
    assert torch.equal(packed.dequantized(), weights)
    assert packed.rows == 48 and packed.cols == 96
    per_weight = packed.nbytes / weights.numel()
    assert per_weight <= (1 + 4 / BLOCK if format == "int8" else 0.5 + 4 / BLOCK)


@pytest.mark.parametrize("format", ["int8", "int4"])
def test_other_weights_are_rounded_to_their_block_grid(format):
    weights = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    packed = pack(weights, format)
    assert packed.exact < 0.1
    assert packed.scales is not None
    step = packed.scales.float().repeat_interleave(BLOCK, dim=1)
    error = (packed.dequantized() - weights).abs()
    assert bool((error <= step * 0.5 + 1e-6).all())


def test_float_formats_are_the_tensor_itself_or_a_rounded_copy():
    weights = torch.randn(16, 32)
    assert pack(weights, "float32").data.data_ptr() == weights.data_ptr()  # no copy
    bf16 = pack(weights, "bfloat16")
    assert bf16.data.dtype == torch.bfloat16 and bf16.exact == 0.0
    assert pack(weights.bfloat16().float(), "bfloat16").exact == 1.0


def test_each_mode_names_its_formats_and_refuses_unknown_ones():
    assert formats_for("model", torch.float32) == ("float32", "float32")
    assert formats_for("model", torch.bfloat16) == ("bfloat16", "bfloat16")
    assert formats_for("auto", torch.float32) == ("float32", "float32")  # until the step decides
    assert formats_for("int4", torch.float32) == ("int4", "int8")  # lm_head at 8 bits
    assert formats_for("int8", torch.bfloat16) == ("int8", "int8")
    with pytest.raises(ValueError, match="unknown decode weights"):
        formats_for("int3", torch.float32)
    with pytest.raises(ValueError, match="decode_weights"):
        EngineConfig(decode_weights="int3")


def test_the_setting_reaches_the_engine_config(monkeypatch):
    from app.settings import Settings

    monkeypatch.setenv("KVMOSAIC_DECODE_WEIGHTS", "int4")
    assert Settings().engine_config().decode_weights == "int4"


def test_reduced_weights_without_the_native_step_are_refused_at_load(smol_tokenizer):
    loaded = tiny_family(smol_tokenizer, "llama")
    with pytest.raises(ValueError, match="need the native decode step"):
        DecoderStack(loaded, "torch", "int8")
    with pytest.raises(ValueError, match="unknown decode weights"):
        DecoderStack(loaded, "native", "int3")


def gguf_model(tokenizer):
    """The tiny llama with GGUF-dequantized weights, as the embedded SmolLM2 is: Q4_1 layers and
    a Q8_0 embedding (tied lm_head)."""
    loaded = tiny_family(tokenizer, "llama", seed=2)
    with torch.no_grad():
        for seed, (name, param) in enumerate(loaded.model.named_parameters()):
            if param.dim() == 2:
                kind = "q8_0" if "embed" in name else "q4_1"
                param.copy_(gguf_blocks(*param.shape, kind, seed=seed))
    return loaded


@pytest.mark.skipif(not _supported(), reason="needs a C compiler and AVX-512F or AVX2")
def test_every_mode_decodes_gguf_weights_like_the_model_and_bfloat16_near_it(smol_tokenizer):
    loaded = gguf_model(smol_tokenizer)
    lengths, tokens = [5, 200, 31], [3, 40, 7]
    caches = random_caches(loaded.spec, lengths, seed=4)
    logits, grown = {}, {}
    for mode in ("model", "int8", "int4", "bfloat16"):
        stack = DecoderStack(loaded, "native", mode)
        mine = [clone(c) for c in caches]
        logits[mode] = in_own_thread(lambda: decode_batch(stack, mine, tokens))  # noqa: B023
        grown[mode] = mine
        assert stack.native is not None and stack.native.weights == mode
        if mode != "bfloat16":
            assert stack.native.exact == 1.0
    assert torch.equal(logits["int8"], logits["model"])
    assert torch.equal(logits["int4"], logits["model"])
    for a, b in zip(grown["int4"], grown["model"]):
        assert torch.equal(a.data, b.data)
    scale = float(logits["model"].abs().max())
    torch.testing.assert_close(logits["bfloat16"], logits["model"], rtol=0.05, atol=0.05 * scale)


@pytest.mark.skipif(not _supported(), reason="needs a C compiler and AVX-512F or AVX2")
def test_auto_takes_the_fewest_exact_bytes_and_keeps_the_models_weights_otherwise(smol_tokenizer):
    caches = random_caches(tiny_family(smol_tokenizer, "llama").spec, [9, 64], seed=5)
    for loaded, expected in (
        (gguf_model(smol_tokenizer), "int4"),  # every block recovered: 4 bits, the same bits
        (tiny_family(smol_tokenizer, "llama"), "model"),  # random weights fit no block grid
    ):
        logits = {}
        for mode in ("auto", "model"):
            stack = DecoderStack(loaded, "native", mode)
            mine = [clone(c) for c in caches]
            logits[mode] = in_own_thread(lambda: decode_batch(stack, mine, [3, 4]))  # noqa: B023
            if mode == "auto":
                assert stack.native is not None and stack.native.weights == expected
                assert stack.native.exact == 1.0
        assert torch.equal(logits["auto"], logits["model"])


def test_auto_falls_back_to_the_twin_where_the_native_step_cannot_run(smol_tokenizer):
    stack = DecoderStack(tiny_family(smol_tokenizer, "llama"), "torch", "auto")  # no error
    assert stack.native_unfit is not None


@pytest.mark.slow
@pytest.mark.skipif(not _supported(), reason="needs a C compiler and AVX-512F or AVX2")
def test_the_embedded_smollm2_decodes_bitwise_alike_in_int4_and_int8(smol_engine):
    """SmolLM2 ships as GGUF Q4_1 layers and a Q8_0 embedding: every block is recovered, so the
    4-bit and 8-bit decodes are the float32 model's to the bit at a fraction of its bytes."""
    stack = smol_engine.stack
    spec = stack.spec
    caches = [KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, 40, torch.float32, CPU)]
    caches[0].data.normal_(generator=torch.Generator().manual_seed(0))
    caches[0].length = 30
    results, sizes = {}, {}
    for mode in ("model", "int8", "int4"):
        mine = DecoderStack(smol_engine.loaded, stack.decode_attention, mode)
        results[mode] = smol_engine.compute(lambda: decode_batch(mine, [clone(caches[0])], [42]))  # noqa: B023
        assert mine.native is not None and mine.native.exact == 1.0
        sizes[mode] = mine.native.weight_bytes
    assert torch.equal(results["int8"], results["model"])
    assert torch.equal(results["int4"], results["model"])
    assert sizes["int4"] < sizes["int8"] < sizes["model"] / 3


@pytest.mark.skipif(not _supported(), reason="needs a C compiler and AVX-512F or AVX2")
def test_auto_takes_the_measured_rounded_weights_when_none_is_exact(smol_tokenizer):
    loaded = tiny_family(smol_tokenizer, "llama")  # random weights fit no block grid
    caches = random_caches(loaded.spec, [9, 64], seed=5)
    stack = DecoderStack(loaded, "native", "auto", rounded_decode_weights="int8")
    auto = in_own_thread(lambda: decode_batch(stack, [clone(c) for c in caches], [3, 4]))
    assert stack.native is not None and stack.native.weights == "int8"
    assert stack.native.exact < 1.0  # rounded: close to the model's decode, not equal
    int8 = DecoderStack(loaded, "native", "int8")
    assert torch.equal(auto, in_own_thread(lambda: decode_batch(int8, caches, [3, 4])))


@pytest.mark.skipif(not _supported(), reason="needs a C compiler and AVX-512F or AVX2")
def test_auto_takes_measured_rounded_weights_narrower_than_the_exact_format(smol_tokenizer):
    loaded = tiny_family(smol_tokenizer, "llama")
    with torch.no_grad():  # every weight a bfloat16 value: `bfloat16` holds them exactly
        for parameter in loaded.model.parameters():
            parameter.copy_(parameter.bfloat16().float())
    caches = random_caches(loaded.spec, [9, 64], seed=6)
    chosen = {}
    for rounded in (None, "int8"):
        stack = DecoderStack(loaded, "native", "auto", rounded_decode_weights=rounded)
        in_own_thread(lambda stack=stack: decode_batch(stack, [clone(c) for c in caches], [3, 4]))
        assert stack.native is not None
        chosen[rounded] = stack.native.weights
    assert chosen == {None: "bfloat16", "int8": "int8"}


def test_only_measured_models_and_dtypes_have_rounded_decode_weights():
    from engine.model.known import rounded_decode_weights

    for dtype in ("float32", "bfloat16"):  # both judged on the report cases (decode.md)
        assert rounded_decode_weights("qwen2.5-coder-0.5b", None, dtype) == "int8"
    assert rounded_decode_weights("qwen2.5-coder-0.5b", None, "float16") is None  # not judged
    assert rounded_decode_weights(None, None, "float32") is None  # SmolLM2: exact int4
    assert rounded_decode_weights(None, None, "bfloat16") == "int4"  # SmolLM2: rounded there
    assert rounded_decode_weights(None, "/models/some.gguf", "float32") is None  # nobody measured
