"""Prefill's products in row tiles (engine/model/row_tiles.py): every call has exactly the
tile's rows, a row's bits do not depend on the rows computed with it, decode is not tiled."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig
from engine.engine import Engine
from engine.model.decode import twin_batch
from engine.model.linear import OneDnnLinear, onednn_agrees
from engine.model.row_tiles import ROW_TILE, by_row_tiles, row_tile_for
from engine.planners import Mode
from tests.conftest import build_tiny_model
from tests.engine.helpers import QUESTION, chunk_inputs


def recording(calls: list[int], weight: torch.Tensor):
    def rowwise(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, weight)

    return rowwise


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_every_call_has_the_tile_s_rows_and_the_result_is_the_rows_own(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(6, 4, generator=generator)
    x = torch.randn(rows, 4, generator=generator)
    calls: list[int] = []
    out = by_row_tiles(recording(calls, weight), x, tile=16)
    assert calls == [16] * -(-rows // 16)
    assert out.shape == (rows, 6)
    assert torch.allclose(out, torch.nn.functional.linear(x, weight), atol=1e-6)


def test_no_tile_is_one_call():
    calls: list[int] = []
    by_row_tiles(recording(calls, torch.ones(3, 2)), torch.ones(300, 2), tile=None)
    assert calls == [300]
    assert row_tile_for(torch.device("cpu")) == ROW_TILE
    assert row_tile_for(torch.device("meta")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(896, 4864), (4864, 896), (128, 896)])
def test_a_tail_s_rows_are_the_whole_s_bit_for_bit(dtype, shape):
    """In a real model's shapes (Qwen2.5-Coder-0.5B's down, up and k projections): the rows of
    any tail, computed in tiles, are those of all rows computed in tiles. Without tiles this
    failed for MKL's float32 and oneDNN's bfloat16 on AMX (docs/benchmarks/bfloat16.md)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(*shape, generator=generator) / shape[1] ** 0.5).to(dtype)
    x = torch.randn(700, shape[1], generator=generator).to(dtype)

    def linear(rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(rows, weight)

    whole = by_row_tiles(linear, x, ROW_TILE)
    for start in (1, 77, 300, 650, 698):
        assert torch.equal(by_row_tiles(linear, x[start:], ROW_TILE), whole[start:])
    assert torch.equal(by_row_tiles(linear, x[5:9], ROW_TILE), whole[5:9])


@pytest.fixture(scope="module")
def engine(smol_tokenizer, tmp_path_factory) -> Engine:
    from engine.model.loader import wrap_model

    return Engine(
        EngineConfig(data_dir=tmp_path_factory.mktemp("tiles"), encode_dtype="engine"),
        wrap_model(build_tiny_model(len(smol_tokenizer)), smol_tokenizer),
    )


def test_unpadded_tiles_end_with_the_rows_left():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 4, generator=generator)
    for rows, expected in ((5, [5]), (16, [16]), (40, [16, 16, 8]), (48, [16, 16, 16])):
        calls: list[int] = []
        x = torch.randn(rows, 4, generator=generator)
        out = by_row_tiles(recording(calls, weight), x, tile=16, pad=False)
        assert calls == expected
        assert torch.allclose(out, torch.nn.functional.linear(x, weight), atol=1e-6)


def test_prefill_runs_its_products_in_tiles_and_decode_does_not(engine):
    chunks = chunk_inputs(engine)  # ingest (tiled too) before the hook
    engine.stack.row_tile, engine.stack.pad_tiles = ROW_TILE, True  # whatever the probe said
    calls: list[int] = []
    q_proj = engine.stack.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    try:
        result = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
        assert calls and set(calls) == {ROW_TILE}
        assert len(calls) == -(-result.layout.total_len // ROW_TILE)
        calls.clear()
        twin_batch(engine.stack, [result.cache], [1])
        assert calls == [1]
    finally:
        hook.remove()


@pytest.mark.skipif(not onednn_agrees(torch.bfloat16), reason="needs oneDNN's bfloat16 linear")
def test_a_packed_onednn_weight_serves_tiles_alike_and_survives_a_copy():
    """bfloat16 oneDNN linears read a packed copy of the weight for tiles: the tail's rows are
    still the whole's, the result is the plain weight's to rounding, and a deep copy (the
    encode-dtype model copy) repacks its own."""
    generator = torch.Generator().manual_seed(1)
    plain = torch.nn.Linear(96, 40, device="meta")
    plain.weight = torch.nn.Parameter(torch.randn(40, 96, generator=generator).bfloat16())
    plain.bias = torch.nn.Parameter(torch.randn(40, generator=generator).bfloat16())
    layer = OneDnnLinear(plain, packed_rows=16)
    x = torch.randn(50, 96, generator=generator).bfloat16()
    whole = by_row_tiles(layer, x, 16)
    assert layer._packed is not None
    assert torch.equal(by_row_tiles(layer, x[7:], 16), whole[7:])
    expected = torch.nn.functional.linear(x.float(), plain.weight.float(), plain.bias.float())
    assert torch.allclose(whole.float(), expected, atol=0.1, rtol=0.02)
    twin = copy.deepcopy(layer)
    assert twin._packed is None
    assert torch.equal(by_row_tiles(twin, x, 16), whole)
    twin.float()  # a cast drops the packed bfloat16 weight: products follow the new weight
    assert by_row_tiles(twin, x.float(), 16).dtype == torch.float32
