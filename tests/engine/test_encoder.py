"""Packed chunk encoding: the same base-variant KV as encoding each chunk alone."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequest, PromptTooLong
from engine.model.encoder import batches


def _chunks(engine):
    texts = [
        "The tide mill at Saltcote ground grain for two centuries.",
        (
            "Guillemots nest on the cliffs of Skarra Island every spring, and the ferry slows "
            "near them."
        ),
        "A short one.",
        " ".join(f"Line {i} of a longer passage about breakwaters and storms." for i in range(12)),
    ]
    return [engine.chunk_ids(t) for t in texts]


@pytest.mark.parametrize("batch_tokens", [10_000, 60, 1])
def test_packed_kv_equals_one_chunk_at_a_time(tiny_engine, batch_tokens):
    chunks = _chunks(tiny_engine)
    packed = tiny_engine.encode_chunks(chunks, batch_tokens)
    assert len(packed) == len(chunks)
    for ids, kv in zip(chunks, packed):
        alone = tiny_engine.encode_chunk(ids)
        assert (
            kv.token_ids == tuple(ids) and kv.kv.shape == alone.kv.shape and kv.kv.is_contiguous()
        )
        assert (kv.base_position, kv.fingerprint, kv.prefix_digest, kv.context) == (
            alone.base_position,
            alone.fingerprint,
            alone.prefix_digest,
            (),
        )
        torch.testing.assert_close(kv.kv, alone.kv, rtol=1e-5, atol=1e-5)


def test_packed_chunks_never_see_each_other(tiny_engine):
    """Changing one chunk leaves the KV of the chunks packed beside it unchanged."""
    chunks = _chunks(tiny_engine)
    before = tiny_engine.encode_chunks(chunks)
    after = tiny_engine.encode_chunks(
        [chunks[0], tiny_engine.chunk_ids("Something else entirely."), *chunks[2:]]
    )
    for i in (0, 2, 3):
        torch.testing.assert_close(after[i].kv, before[i].kv, rtol=1e-6, atol=1e-6)


def test_batches_keep_within_the_token_budget_and_order():
    assert list(batches([5, 5, 5, 20, 1], 10)) == [[0, 1], [2], [3], [4]]
    assert list(batches([], 10)) == []
    with pytest.raises(ValueError):
        list(batches([1], 0))


def test_bad_chunks_are_refused(tiny_engine):
    with pytest.raises(InvalidRequest):
        tiny_engine.encode_chunks([(1, 2), ()])
    with pytest.raises(PromptTooLong):
        tiny_engine.encode_chunks([(5,) * (tiny_engine.loaded.spec.max_positions + 1)])


def test_bfloat16_encoding_is_close_to_the_engines_and_served_in_its_dtype(tiny_loaded, tmp_path):
    from engine import EngineConfig
    from engine.engine import Engine

    exact = Engine(EngineConfig(data_dir=tmp_path, encode_dtype="engine"), tiny_loaded)
    rounded = Engine(EngineConfig(data_dir=tmp_path, encode_dtype="bfloat16"), tiny_loaded)
    chunks = _chunks(exact)
    for a, b in zip(exact.encode_chunks(chunks), rounded.encode_chunks(chunks)):
        assert b.kv.dtype == a.kv.dtype == torch.float32 and b.kv.shape == a.kv.shape
        assert (b.fingerprint, b.prefix_digest, b.base_position) == (
            a.fingerprint,
            a.prefix_digest,
            a.base_position,
        )
        assert not torch.equal(a.kv, b.kv)  # really computed in bfloat16 ...
        relative = float((a.kv - b.kv).norm() / a.kv.norm())
        assert relative < 0.05, relative  # ... to bfloat16's rounding, not another model
    assert next(rounded.encoder.stack.layers.parameters()).dtype == torch.bfloat16
    assert (
        next(exact.stack.layers.parameters()).dtype == torch.float32
    )  # the engine's own model is untouched


def test_auto_encode_dtype_is_bfloat16_only_for_float32_on_an_amx_cpu(tiny_loaded, tmp_path):
    from engine import EngineConfig
    from engine.model.cpu import cpu_has_amx_bf16
    from engine.model.encode_dtype import resolve_encode_dtype

    assert resolve_encode_dtype("auto", tiny_loaded, amx=True) == torch.bfloat16
    assert resolve_encode_dtype("auto", tiny_loaded, amx=False) == torch.float32
    assert resolve_encode_dtype("engine", tiny_loaded, amx=True) == torch.float32
    assert resolve_encode_dtype("float16", tiny_loaded) == torch.float16
    with pytest.raises(ValueError, match="encode_dtype"):
        EngineConfig(data_dir=tmp_path, encode_dtype="int8")
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu avx512f amx_bf16 amx_tile\n")
    assert cpu_has_amx_bf16.__wrapped__(info)
    info.write_text("processor : 0\nflags : fpu avx512f avx512_bf16\n")
    assert not cpu_has_amx_bf16.__wrapped__(info)
    assert not cpu_has_amx_bf16.__wrapped__(tmp_path / "absent")


def test_auto_dtype_is_bfloat16_on_an_amx_cpu_float32_on_others_and_float16_on_cuda():
    from engine.model.loader import resolve_dtype

    assert resolve_dtype("auto", "cpu", amx=True) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", amx=False) == torch.float32
    assert resolve_dtype("auto", "cuda:0", amx=True) == torch.float16
    assert resolve_dtype("float32", "cpu", amx=True) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", "cpu")
