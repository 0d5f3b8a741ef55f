"""Rows that read their chunks between learned packets (`packets=1`) in the fidelity bench."""

from __future__ import annotations

import pytest
import torch

from bench.fidelity.fidelity import (
    FidelityOptions,
    base_variant_chunks,
    mode_books,
    reads_packets,
    row_config,
)
from engine.adapt.packets import Packets
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import PASSAGES, engine_with_packets


def test_a_row_names_packets_or_not(tiny_engine):
    assert reads_packets("naive@fast[packets=1]") and reads_packets("focus[packets=true]")
    assert not reads_packets("naive@fast") and not reads_packets("naive[packets=0]")
    assert row_config("naive[packets=1]", tiny_engine.config) == tiny_engine.config


def packets_case(smol_tokenizer, tmp_path) -> tuple[Engine, list[ChunkInput], FidelityOptions]:
    """An engine with random packets of 2 + 3 tokens, three passages' bases, the options."""
    path = tmp_path / "packets.safetensors"
    Packets(torch.randn(2, 64), torch.randn(3, 64)).save(path, {})
    engine = engine_with_packets(smol_tokenizer, tmp_path, str(path))
    record = {"question": "Who?", "ctxs": [{"title": t, "text": x} for t, x in PASSAGES]}
    base = base_variant_chunks(engine, record, 3, 0)
    return engine, base, FidelityOptions(dataset=tmp_path / "unused.json", chunks=3)


def test_a_packets_row_draws_chunks_between_the_packets(smol_tokenizer, tmp_path):
    engine, base, options = packets_case(smol_tokenizer, tmp_path)
    labels = ("naive", "naive[packets=1]")
    books = mode_books(engine, "Who?", base, options, labels, 0)
    ids = [c.chunk_id for c in base]
    plain = books["naive"][0].inputs(ids, Mode.named("naive"))
    packeted = books[labels[1]][0].inputs(ids, Mode.named("naive"))
    for before, after in zip(plain, packeted):
        assert after.token_ids == engine.packeted(before.token_ids)
        assert after.kv.num_tokens == before.kv.num_tokens + 5
    with pytest.raises(InvalidRequest, match="not both"):
        mode_books(engine, "Who?", base, options, ("naive[packets=1;neighbours=1]",), 0)
