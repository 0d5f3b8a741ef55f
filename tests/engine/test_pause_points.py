"""A prefill's pause points: where they fall (between layers, between blocks of a long layer's
rows) and that work run there changes none of the prefill's bits."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import MIN_ROW_BLOCK, ROW_BLOCK, row_blocks
from engine.model.runner import LayerRunner
from engine.plan import Plan


@pytest.mark.parametrize(
    ("rows", "sizes"),
    [
        (1, [1]),
        (ROW_BLOCK, [ROW_BLOCK]),
        (ROW_BLOCK + MIN_ROW_BLOCK, [ROW_BLOCK, MIN_ROW_BLOCK]),
        (ROW_BLOCK + MIN_ROW_BLOCK - 1, [ROW_BLOCK + MIN_ROW_BLOCK - 1]),
        (2 * ROW_BLOCK + 100, [ROW_BLOCK, ROW_BLOCK, 100]),
    ],
)
def test_row_blocks_cover_the_rows_with_no_small_remainder(rows, sizes):
    blocks = row_blocks(rows)
    assert [b.stop - b.start for b in blocks] == sizes
    assert blocks[0].start == 0 and blocks[-1].stop == rows
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))


def full_plan(total: int) -> Plan:
    return Plan([], torch.arange(total), pinned=torch.ones(total, dtype=torch.bool))


def busy_work() -> None:
    """Work unlike the prefill's own, as a decode step between its layers would be."""
    x = torch.randn(300, 300)
    torch.softmax(x @ x.T, dim=-1).sum()


def test_pause_points_fall_between_layers_and_row_blocks_and_change_nothing(tiny_engine):
    stack = tiny_engine.stack
    total = ROW_BLOCK + 200  # two blocks of rows per layer
    ids = torch.randint(3, 1000, (total,), generator=torch.Generator().manual_seed(0))
    calls = []

    def pause() -> None:
        calls.append(1)
        busy_work()

    with torch.inference_mode():
        plain = LayerRunner(stack).run(ids, full_plan(total), capacity=total)
        paused = LayerRunner(stack, pause_point=pause).run(ids, full_plan(total), capacity=total)
    layers = stack.spec.num_layers
    assert len(calls) == (layers - 1) + layers  # between layers, and once inside each layer
    assert torch.equal(paused.logits, plain.logits)
    assert torch.equal(paused.cache.data, plain.cache.data)
