"""The rules of neighbour-conditioned bases: which chunks lead a base, in what order, and what
names its kind in the store."""

from __future__ import annotations

import pytest

from app.variants.conditioned import Candidate, Conditioning, lead_of, nearest
from engine.errors import InvalidRequest


def chunk(chunk_id: int, text: str = "", length: int = 5) -> Candidate:
    return Candidate(
        chunk_id, text or f"text {chunk_id}", tuple(range(chunk_id * 10, chunk_id * 10 + length))
    )


def test_nearest_takes_the_highest_scores_leaving_out_itself_copies_and_repeats():
    own = chunk(1, "same words")
    scored = [
        (0.99, own),  # itself, as the index finds it
        (0.95, chunk(2, "same words")),  # a copy of its text
        (0.90, chunk(3)),
        (0.90, chunk(3)),  # the same chunk from the document and from the index
        (0.40, chunk(4)),
        (0.70, chunk(5)),
    ]
    assert [c.chunk_id for c in nearest(own, scored, 2)] == [3, 5]
    assert [c.chunk_id for c in nearest(own, scored, 9)] == [3, 5, 4]
    assert nearest(own, [(1.0, own)], 2) == []


def test_nearest_keeps_the_given_order_among_equal_scores():
    own = chunk(1)
    assert [c.chunk_id for c in nearest(own, [(0.5, chunk(8)), (0.5, chunk(6))], 1)] == [8]


def test_the_lead_puts_the_nearest_last_and_cuts_each_neighbour():
    near = [chunk(3, length=4), chunk(5, length=2)]  # 3 nearest
    ids, lead = lead_of(near, 3)
    assert lead == (5, 3)
    assert ids == (50, 51, 30, 31, 32)
    assert lead_of([], 3) == ((), ())


def test_the_tag_names_both_knobs_and_bad_ones_are_refused():
    assert Conditioning(2).tag == "lead:2x64"
    assert Conditioning(2, 32).tag != Conditioning(2, 64).tag != Conditioning(3, 64).tag
    assert Conditioning(1, 8).describe() == {"neighbours": 1, "lead_tokens": 8}
    for bad in ((0, 64), (2, 0)):
        with pytest.raises(InvalidRequest, match="at least 1"):
            Conditioning(*bad)
