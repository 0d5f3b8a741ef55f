"""`kvmosaic bench prefill` on the tiny model: a full prefill, its arithmetic and the table."""

from __future__ import annotations

import pytest

from bench.compute.prefill import PrefillFigures, format_table, full_prefill, prefill_flops
from engine.model.layers import DecoderStack


def test_a_full_prefill_runs_and_its_flops_grow_faster_than_its_rows(tiny_loaded):
    stack = DecoderStack(tiny_loaded)
    full_prefill(stack, 24)()
    assert prefill_flops(stack, 48) > 2 * prefill_flops(stack, 24) > 0  # attention by position


def test_the_table_puts_tokens_per_second_against_the_floor():
    row = PrefillFigures("m", "float32", 512, 2.0, 100e9, 100e9, None)
    assert row.tokens_per_s == 256 and row.of_peak == pytest.approx(0.5)
    assert row.floor_tokens_per_s == pytest.approx(512)
    assert "| m | float32 | 512 | 2.00 | 256 | 100 | 100.0 | 50% | 512 | – |" in format_table([row])
