"""A fidelity row's cost columns: tokens computed at ingest and KV kept, per chunk token."""

from __future__ import annotations

import math

import pytest

from bench.fidelity.fidelity import (
    FLOOR,
    REFERENCE,
    format_table,
    mode_books,
    summarize_rows,
)
from bench.fidelity.frontier import frontier_table
from bench.fidelity.storage import RowStorage, row_storage, summarize_storage
from engine.plan import ChunkInput
from tests.bench.fidelity.test_merge import _samples
from tests.bench.fidelity.test_packet_rows import packets_case


def _chunks(*lengths: int) -> list[ChunkInput]:
    return [ChunkInput(i, tuple(range(n))) for i, n in enumerate(lengths)]


def test_a_row_that_reads_no_cache_computes_and_keeps_nothing():
    plain = _chunks(10, 30)
    assert row_storage(False, plain, plain, 999) == RowStorage(40, 0, 0)


def test_ingest_counts_the_bases_own_tokens_and_their_leads():
    plain = _chunks(10, 30)
    packeted = _chunks(14, 34)  # two soft tokens before and after each
    assert row_storage(True, plain, plain, 5) == RowStorage(40, 40, 5)
    assert row_storage(True, plain, packeted, 7) == RowStorage(40, 48, 7)
    assert row_storage(True, plain, plain, 5, {0: 6, 1: 6}) == RowStorage(40, 52, 5)


def test_figures_are_totals_per_chunk_token_and_unknown_without_tokens():
    figures = summarize_storage([RowStorage(40, 40, 400), RowStorage(60, 90, 600)])
    assert figures.ingest_per_token == pytest.approx(130 / 100)
    assert figures.stored_bytes_per_token == pytest.approx(10.0)
    unknown = summarize_storage([RowStorage(), RowStorage()])
    assert math.isnan(unknown.ingest_per_token) and math.isnan(unknown.stored_bytes_per_token)


def test_mode_books_charge_plain_and_packeted_rows(smol_tokenizer, tmp_path):
    engine, base, options = packets_case(smol_tokenizer, tmp_path)
    books = mode_books(engine, "Who?", base, options, ("full", "naive", "naive[packets=1]"), 0)
    tokens = sum(len(c.token_ids) for c in base)
    full, plain, packeted = (books[k].storage for k in ("full", "naive", "naive[packets=1]"))
    assert full == RowStorage(tokens, 0, 0)
    assert plain.ingest_tokens == tokens
    assert plain.stored_bytes == sum(c.kv.num_bytes for c in base)
    assert packeted.ingest_tokens == tokens + 5 * len(base)
    per_row = base[0].kv.num_bytes // base[0].kv.num_tokens
    assert packeted.stored_bytes == plain.stored_bytes + 5 * len(base) * per_row


def _with_storage(samples, per_mode):
    """The merge test's samples with each row's storage fields set."""
    for label, rows in samples.items():
        chunk, ingest, stored = per_mode.get(label, (0, 0, 0))
        for s in rows:
            s.chunk_tokens, s.ingest_tokens, s.stored_bytes = chunk, ingest, stored
    return samples


def test_the_report_and_the_frontier_table_carry_the_costs():
    samples = _with_storage(
        _samples(range(4), seed=3), {REFERENCE: (100, 0, 0), "cachecraft": (100, 230, 102400)}
    )
    summaries = summarize_rows(samples, (REFERENCE, "cachecraft"))
    craft = next(s for s in summaries if s.mode == "cachecraft")
    assert craft.ingest_per_token == pytest.approx(2.3)
    assert craft.stored_bytes_per_token == pytest.approx(1024.0)
    table = format_table(summaries)
    assert "ingest" in table and "KiB/tok" in table
    craft_line = next(line for line in table.splitlines() if line.startswith("cachecraft"))
    assert craft_line.split()[-2:] == ["2.30x", "1.0"]
    lines = frontier_table(summaries).splitlines()
    assert lines[0].startswith("| row | accuracy [95%] | vs full [95%] | TTFT vs full")
    assert lines[2].startswith(f"| `{REFERENCE}` |") and "| — |" in lines[2]
    assert lines[3].startswith(f"| {FLOOR} (full, other order) |")
    assert lines[4].startswith("| `cachecraft` |") and lines[4].endswith("| 2.30× | 1.0 |")


def test_a_report_written_before_the_costs_were_counted_shows_dashes():
    summaries = summarize_rows(_samples(range(3), seed=5), (REFERENCE, "cachecraft"))
    craft = next(s for s in summaries if s.mode == "cachecraft")
    assert math.isnan(craft.ingest_per_token)
    assert frontier_table(summaries).splitlines()[-1].endswith("| — | — |")
