"""Neighbour-conditioned bases in the fidelity bench: row settings, nearest passages, books."""

from __future__ import annotations

import numpy as np
import pytest

from bench.fidelity.fidelity import FidelityOptions, base_variant_chunks, mode_books
from bench.fidelity.neighbours import Conditioning, Neighbourhood, Passage
from engine.errors import InvalidRequest
from engine.planners import Mode
from tests.engine.helpers import PASSAGES


def test_a_row_names_its_conditioning_or_none():
    assert Conditioning.of("naive", {}) is None
    assert Conditioning.of("naive", {"neighbours": "2"}) == Conditioning(2, 64)
    assert Conditioning.of("x", {"neighbours": "1", "lead_tokens": "8"}) == Conditioning(1, 8)
    for bad in ({"lead_tokens": "8"}, {"neighbours": "0"}, {"neighbours": "two"}):
        with pytest.raises(InvalidRequest):
            Conditioning.of("x", bad)


def passages(texts: list[str]) -> list[Passage]:
    return [Passage(i, i // 2, f"t{i}", text) for i, text in enumerate(texts)]


def test_the_nearest_leave_out_the_passage_and_copies_of_its_text():
    vectors = np.array([[1, 0], [1, 0], [0.9, 0.1], [0, 1], [0.5, 0.5]], dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    near = Neighbourhood(passages(["a", "a", "b", "c", "d"]), vectors)
    assert [p.chunk_id for p in near.nearest(0, 3)] == [2, 4, 3]  # 1 is a copy of 0's text
    assert [p.chunk_id for p in near.nearest(3, 1)] == [4]


def test_a_conditioned_row_draws_bases_computed_after_its_neighbours(tiny_engine, tmp_path):
    record = {"question": "Who?", "ctxs": [{"title": t, "text": x} for t, x in PASSAGES]}
    base = base_variant_chunks(tiny_engine, record, 4, 0)
    near = Neighbourhood(
        [Passage(c.chunk_id, 0, t, x) for c, (t, x) in zip(base, PASSAGES)],
        np.eye(4, dtype=np.float32) + 0.1,
    )
    options = FidelityOptions(dataset=tmp_path / "unused.json", chunks=4)
    labels = ("naive", "naive[neighbours=1;lead_tokens=4]")
    books = mode_books(tiny_engine, "Who?", base, options, labels, 0, near)
    ids = [c.chunk_id for c in base]
    plain = books["naive"][0].inputs(ids, Mode.named("naive"))
    conditioned = books[labels[1]][0].inputs(ids, Mode.named("naive"))
    assert all(c.kv.lead == () for c in plain)
    assert all(len(c.kv.lead) == 1 for c in conditioned)
    assert all(
        c.kv.base_position == tiny_engine.prompts.prefix_len + 4 for c in conditioned
    )  # every passage here is longer than the 4 lead tokens
    tokens = sum(len(c.token_ids) for c in base)
    assert books[labels[1]].storage.ingest_tokens == tokens + 16  # 4 openings of 4 tokens
    assert books[labels[1]].storage.stored_bytes == books["naive"].storage.stored_bytes
    assert near.report() == [
        "neighbours=1;lead_tokens=4: ingest computed "
        f"{(sum(len(c.token_ids) for c in base) + 16) / sum(len(c.token_ids) for c in base):.2f}"
        " tokens per chunk token (bases alone: 1.00); 4 of 4 neighbours from the chunk's own "
        "record"
    ]
