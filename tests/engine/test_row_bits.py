"""The row-count probe (engine/serving/row_bits.py): a product whose row's bits follow its call's
row count keeps padded tiles; one whose do not runs prefills in unpadded calls, reading packed
weights at any row count, with reused rows still full prefill's bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig
from engine.engine import Engine
from engine.model.linear import OneDnnLinear, onednn_agrees, packed_for_any_rows
from engine.model.row_tiles import FREE_TILE, ROW_TILE
from engine.planners import Mode
from engine.serving import row_bits
from engine.serving.row_bits import rows_change_bits
from tests.conftest import build_tiny_model
from tests.engine.helpers import QUESTION, chunk_inputs


class RowByRow(torch.nn.Linear):
    """A linear layer computing each row in its own product: its rows' bits cannot depend on
    the call's row count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([super(RowByRow, self).forward(row[None])[0] for row in x])


class CountsRows(torch.nn.Linear):
    """A linear layer whose rows change, slightly, with the call's row count (as a library
    that picks its summation order by shape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + (x.shape[0] % 3) * 1e-3


def with_linears(model: torch.nn.Module, kind: type[torch.nn.Linear]) -> torch.nn.Module:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                twin = kind(child.in_features, child.out_features, bias=child.bias is not None)
                twin.load_state_dict(child.state_dict())
                setattr(parent, name, twin)
    return model


@pytest.fixture(scope="module")
def tiny(smol_tokenizer):
    return lambda kind: with_linears(build_tiny_model(len(smol_tokenizer)), kind)


def test_a_product_whose_rows_follow_the_row_count_keeps_padded_tiles(tiny):
    model = tiny(CountsRows)
    assert rows_change_bits(model, threads=1)
    assert rows_change_bits(model, threads=2)


def test_a_product_whose_rows_do_not_runs_unpadded(tiny, smol_tokenizer, tmp_path):
    from engine.model.loader import wrap_model

    model = tiny(RowByRow)
    assert not rows_change_bits(model, threads=2)
    engine = Engine(
        EngineConfig(
            data_dir=tmp_path, fidelity="fast", encode_dtype="engine", linear_kernel="torch"
        ),
        wrap_model(model, smol_tokenizer),
    )
    assert (engine.stack.row_tile, engine.stack.pad_tiles) == (FREE_TILE, False)
    assert engine.summary.endswith(f"prefill rows in tiles of {FREE_TILE}, unpadded")
    chunks = chunk_inputs(engine)
    calls: list[int] = []
    q_proj = engine.stack.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    try:
        full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    finally:
        hook.remove()
    total = full.layout.total_len
    assert sum(calls) == total  # no padded row
    assert calls == [FREE_TILE] * (total // FREE_TILE) + (
        [total % FREE_TILE] if total % FREE_TILE else []
    )
    # a reused exact prefix's tail, computed in calls of other sizes, is full prefill's rows
    prefix = engine.prefill(chunks, QUESTION, mode=Mode.named("prefix"))
    rows = prefix.layout.total_len
    assert torch.equal(prefix.cache.rows(0, rows), full.cache.rows(0, total))


def test_the_verdict_is_probed_once_per_model_and_thread_count(tiny, monkeypatch):
    model = tiny(CountsRows)
    probed: list[int] = []
    real = row_bits._probe
    monkeypatch.setattr(
        row_bits, "_probe", lambda m, threads: probed.append(threads) or real(m, threads)
    )
    for threads in (1, 2, 1, 2):
        assert rows_change_bits(model, threads)
    assert probed == [1, 2]


def test_another_device_is_not_probed(smol_tokenizer):
    model = build_tiny_model(len(smol_tokenizer)).to("meta")
    assert rows_change_bits(model, threads=2)


@pytest.mark.skipif(not onednn_agrees(torch.bfloat16), reason="needs oneDNN's bfloat16 linear")
def test_onednn_reads_its_packed_weight_at_any_row_count_only_when_told():
    generator = torch.Generator().manual_seed(2)
    plain = torch.nn.Linear(96, 40, bias=False)
    plain.weight = torch.nn.Parameter(torch.randn(40, 96, generator=generator).bfloat16())
    layer = OneDnnLinear(plain, packed_rows=ROW_TILE)
    x = torch.randn(37, 96, generator=generator).bfloat16()
    layer(x)
    assert layer._packed is None  # 37 rows, not a tile: the plain weight
    with packed_for_any_rows():
        layer(x[:1])
        assert layer._packed is None  # one row keeps the matrix-vector path
        out = layer(x)
    assert layer._packed is not None
    expected = torch.nn.functional.linear(x.float(), plain.weight.float())
    assert torch.allclose(out.float(), expected, atol=0.1, rtol=0.02)
