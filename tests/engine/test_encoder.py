"""Packed chunk encoding: the same base-variant KV as encoding each chunk alone."""

from __future__ import annotations

import pytest
import torch

from engine.encoder import batches
from engine.errors import InvalidRequest, PromptTooLong


def _chunks(engine):
    texts = ["The tide mill at Saltcote ground grain for two centuries.",
             "Guillemots nest on the cliffs of Skarra Island every spring, and the ferry slows near them.",
             "A short one.",
             " ".join(f"Line {i} of a longer passage about breakwaters and storms." for i in range(12))]
    return [engine.chunk_ids(t) for t in texts]


@pytest.mark.parametrize("batch_tokens", [10_000, 60, 1])
def test_packed_kv_equals_one_chunk_at_a_time(tiny_engine, batch_tokens):
    chunks = _chunks(tiny_engine)
    packed = tiny_engine.encode_chunks(chunks, batch_tokens)
    assert len(packed) == len(chunks)
    for ids, kv in zip(chunks, packed):
        alone = tiny_engine.encode_chunk(ids)
        assert kv.token_ids == tuple(ids) and kv.kv.shape == alone.kv.shape and kv.kv.is_contiguous()
        assert (kv.base_position, kv.fingerprint, kv.prefix_digest, kv.context) == \
            (alone.base_position, alone.fingerprint, alone.prefix_digest, ())
        torch.testing.assert_close(kv.kv, alone.kv, rtol=1e-5, atol=1e-5)


def test_packed_chunks_never_see_each_other(tiny_engine):
    """Changing one chunk leaves the KV of the chunks packed beside it unchanged."""
    chunks = _chunks(tiny_engine)
    before = tiny_engine.encode_chunks(chunks)
    after = tiny_engine.encode_chunks([chunks[0], tiny_engine.chunk_ids("Something else entirely."), *chunks[2:]])
    for i in (0, 2, 3):
        torch.testing.assert_close(after[i].kv, before[i].kv, rtol=1e-6, atol=1e-6)


def test_batches_keep_within_the_token_budget_and_order():
    assert list(batches([5, 5, 5, 20, 1], 10)) == [[0, 1], [2], [3], [4]]
    assert list(batches([], 10)) == []
    with pytest.raises(ValueError):
        list(batches([1], 0))


def test_bad_chunks_are_refused(tiny_engine):
    with pytest.raises(InvalidRequest):
        tiny_engine.encode_chunks([(1, 2), ()])
    with pytest.raises(PromptTooLong):
        tiny_engine.encode_chunks([(5,) * (tiny_engine.loaded.spec.max_positions + 1)])
