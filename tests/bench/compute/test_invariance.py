"""`kvmosaic bench invariance` on small shapes: what it counts and prints."""

from __future__ import annotations

import torch

from bench.compute.invariance import Invariance, Shapes, format_table, run_invariance

SHAPES = Shapes(
    hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=100, rope_theta=1e4
)


def test_every_prefill_op_is_measured_and_row_wise_ops_are_invariant():
    lines: list[str] = []
    results = run_invariance(SHAPES, 40, (1, 8), (torch.float32,), repeats=1, say=lines.append)
    names = {r.name for r in results}
    assert {"RMSNorm", "embedding lookup", "attention over past rows"} <= names
    assert any(name.startswith("linear") for name in names) and len(lines) == len(results)
    by_name = {r.name: r for r in results}
    for name in ("RMSNorm", "embedding lookup", "RoPE (tables + rotation)"):
        assert by_name[name].invariant
    # the engine's attention: a tail of rows gives each row its bits whatever the block
    assert by_name["attention over past rows"].differing[8] == 0


def test_only_keeps_the_named_ops():
    results = run_invariance(SHAPES, 16, (4,), (torch.float32,), repeats=1, say=print, only=["RMS"])
    assert [r.name for r in results] == ["RMSNorm"]


def test_the_table_marks_equal_blocks_and_counts_differing_rows():
    same = Invariance("op", "k", torch.float32, {4: 0, 8: 3}, {4: 0.0, 8: 1e-6}, 2.0)
    half = Invariance("op", "k", torch.bfloat16, {4: 0, 8: 0}, {4: 0.0, 8: 0.0}, 4.0)
    table = format_table([same, half], 16, (4, 8, 32))
    assert "| op | k | float32 | = | 3 rows |" in table and "0.50×" in table
    assert "b=32" not in table  # blocks as large as all rows are left out


def test_rows_are_compared_across_thread_counts_on_a_thread_of_their_own():
    from engine.serving.threads import in_own_thread

    def on_two_threads() -> list[Invariance]:
        return run_invariance(
            SHAPES, 40, (8,), (torch.float32,), repeats=1, say=print, only=["RMS"], threads=(1, 2)
        )

    (result,) = in_own_thread(on_two_threads, threads=2)
    assert list(result.by_threads) == [1]  # its own count (2) is not compared with itself
    assert result.by_threads[1] == 0 and result.invariant


def test_a_thread_count_that_changes_bits_is_counted_and_printed():
    same = Invariance("op", "k", torch.float32, {4: 0}, {4: 0.0}, 2.0, by_threads={1: 0})
    moved = Invariance("op", "j", torch.float32, {4: 0}, {4: 0.0}, 2.0, by_threads={1: 5})
    assert same.invariant and not moved.invariant
    table = format_table([same, moved], 16, (4,))
    assert "| 1 thr |" in table and "| op | j | float32 | = | 5 rows |" in table
