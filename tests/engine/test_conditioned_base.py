"""A neighbour-conditioned base (`Engine.encode_after`): the rows full prefill computes after
the same lead, and exact in no prompt (it never stands in for an exact prefix)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequest
from engine.kv import exact_context
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import QUESTION, chunk_inputs, plan_request


def test_its_rows_are_full_prefills_after_the_lead(tiny_engine):
    lead, chunk = chunk_inputs(tiny_engine, cached=False)[:2]
    conditioned = tiny_engine.encode_after(chunk.token_ids, lead.token_ids, (lead.chunk_id,))
    full = tiny_engine.prefill([lead, chunk], QUESTION, mode=Mode.named("full"))
    start, end = full.layout.chunk_spans[1]
    assert conditioned.base_position == start
    assert conditioned.token_ids == tuple(chunk.token_ids)
    assert conditioned.lead == (lead.chunk_id,) and conditioned.context == ()
    torch.testing.assert_close(conditioned.kv, full.cache.rows(start, end), rtol=1e-5, atol=1e-5)
    assert exact_context(conditioned) is None


def test_a_cut_lead_makes_it_differ_from_the_base_alone(tiny_engine):
    lead, chunk = chunk_inputs(tiny_engine)[:2]
    conditioned = tiny_engine.encode_after(chunk.token_ids, lead.token_ids[:3], (lead.chunk_id,))
    assert conditioned.base_position == tiny_engine.prompts.prefix_len + 3
    assert not torch.allclose(conditioned.kv, chunk.kv.kv)


def test_first_in_the_prompt_it_is_not_an_exact_prefix(tiny_engine):
    chunks = chunk_inputs(tiny_engine)[:2]
    lead = chunk_inputs(tiny_engine)[2]
    conditioned = tiny_engine.encode_after(chunks[0].token_ids, lead.token_ids, (lead.chunk_id,))
    first = ChunkInput(chunks[0].chunk_id, chunks[0].token_ids, conditioned)
    request = plan_request(tiny_engine, [first, chunks[1]])
    assert request.exact_chunks(None) == [False, False]
    start = request.layout.chunk_spans[0][0]
    assert request.chunk_heads(3)[start : start + 3].all()  # its opening rows read the lead
    # `prefix` reuses exact rows only: it computes the conditioned chunk, as full does
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    prefix = tiny_engine.prefill([first, chunks[1]], QUESTION, mode=Mode.named("prefix"))
    torch.testing.assert_close(prefix.logits, full.logits, rtol=1e-4, atol=1e-4)


def test_an_empty_chunk_is_refused(tiny_engine):
    with pytest.raises(InvalidRequest):
        tiny_engine.encode_after((), (1, 2), (0,))


def test_packed_they_are_each_one_encoded_alone_after_its_lead(tiny_engine):
    """`encode_many_after` packs several leads and chunks into one pass (a lead of its own
    length each, one chunk without a lead's neighbours in it): each is `encode_after`'s."""
    chunks = chunk_inputs(tiny_engine, cached=False)
    items = [
        (chunks[0].token_ids, chunks[1].token_ids[:4], (chunks[1].chunk_id,)),
        (chunks[1].token_ids, chunks[2].token_ids + chunks[0].token_ids[:2], (2, 0)),
        (chunks[2].token_ids, chunks[0].token_ids[:1], (chunks[0].chunk_id,)),
    ]
    packed = tiny_engine.encode_many_after(items, batch_tokens=64)
    for kv, (token_ids, lead_ids, lead) in zip(packed, items, strict=True):
        alone = tiny_engine.encode_after(token_ids, lead_ids, lead)
        assert (kv.token_ids, kv.lead, kv.base_position) == (
            alone.token_ids,
            alone.lead,
            alone.base_position,
        )
        torch.testing.assert_close(kv.kv, alone.kv, rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidRequest):
        tiny_engine.encode_many_after([((), (1,), (0,))])
