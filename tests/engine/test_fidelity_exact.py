"""Exact checks of the runner and the modes against the full-prefill reference (tiny model)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig
from engine.config import Fidelity
from engine.decoding import read_out
from engine.engine import Engine
from engine.kv import ChunkKV
from engine.model import ops
from engine.model.decode import SamplingParams
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import PASSAGES, QUESTION, chunk_inputs, kl


def hf_last_logits(engine, layout) -> torch.Tensor:
    with torch.no_grad():
        return engine.loaded.model(layout.token_tensor()[None]).logits[0, -1].float()


def true_context_chunks(engine, chunks, question) -> list[ChunkInput]:
    """Each chunk's KV as computed inside the full prompt, moved back to the base position.

    The naive mode must shift it forward again; if assembly or the shift were wrong, naive
    would differ from full.
    """
    full = engine.prefill(chunks, question, mode=Mode.named("full"), max_new_tokens=1)
    base = engine.prompts.prefix_len
    moved = []
    for i, (chunk, (start, end)) in enumerate(zip(chunks, full.layout.chunk_spans)):
        rows = full.cache.rows(start, end)
        ops.rope_shift_(rows[:, 0], base - start, engine.stack.inv_freq)
        kv = ChunkKV(
            chunk.token_ids,
            rows,
            base,
            engine.fingerprint,
            engine.prompts.prefix_digest,
            context=tuple(c.chunk_id for c in chunks[:i]),
        )
        moved.append(ChunkInput(chunk.chunk_id, chunk.token_ids, kv))
    return moved


def test_full_equals_hugging_face_forward(tiny_engine):
    chunks = chunk_inputs(tiny_engine, cached=False)
    result = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    reference = hf_last_logits(tiny_engine, result.layout)
    torch.testing.assert_close(result.logits, reference, rtol=1e-4, atol=1e-4)


def test_naive_with_true_context_kv_equals_full(tiny_engine):
    chunks = chunk_inputs(tiny_engine, cached=False)
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    naive = tiny_engine.prefill(
        true_context_chunks(tiny_engine, chunks, QUESTION), QUESTION, mode=Mode.named("naive")
    )
    torch.testing.assert_close(naive.logits, full.logits, rtol=1e-4, atol=1e-4)
    assert naive.recomputed_tokens == 0


def test_naive_with_base_kv_differs_from_full(tiny_engine):
    """Guard for the test above: reuse of alone-computed KV is not exact."""
    chunks = chunk_inputs(tiny_engine)
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    naive = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    assert kl(full.logits, naive.logits) > 1e-6


@pytest.mark.parametrize("mode", ["cacheblend", "prefix"])
def test_mode_that_recomputes_everything_equals_full(tiny_engine, mode):
    chunks = chunk_inputs(tiny_engine)
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    result = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named(mode), ratio=1.0)
    torch.testing.assert_close(result.logits, full.logits, rtol=1e-4, atol=1e-4)
    layout = full.layout
    torch.testing.assert_close(
        result.cache.data[:, :, :, : layout.total_len],
        full.cache.data[:, :, :, : layout.total_len],
        rtol=1e-4,
        atol=1e-4,
    )


def test_cacheblend_recomputes_the_requested_share(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    result = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.25)
    expected = -(-result.context_tokens * 25 // 100)  # ceil
    assert result.recomputed_tokens == expected
    assert result.mode.name == "cacheblend"


def test_cacheblend_is_closer_to_full_than_naive(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    naive = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    blend = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.5)
    assert kl(full.logits, blend.logits) < kl(full.logits, naive.logits)


@pytest.mark.parametrize("mode,ratio", [("epic", None), ("cacheblend", 1.0)])
def test_recomputed_interior_rows_never_see_later_tokens(tiny_engine, mode, ratio):
    """Rows recomputed in chunk 1 must not change when chunk 2 changes (exact causal mask).

    epic recomputes a sparse set of rows; cacheblend at r = 1 recomputes every row after the
    prefix as one block of queries. (At r < 1 the global top-k could pick other rows.)
    """
    original = chunk_inputs(tiny_engine)
    changed_passages = (
        PASSAGES[:2]
        + [("Other", "Completely different words about volcanoes and lava.")]
        + PASSAGES[3:]
    )
    changed = chunk_inputs(tiny_engine, changed_passages)
    first = tiny_engine.prefill(original, QUESTION, mode=Mode.named(mode), ratio=ratio)
    second = tiny_engine.prefill(changed, QUESTION, mode=Mode.named(mode), ratio=ratio)
    start, end = first.layout.chunk_spans[1]
    assert first.chunks[1].recomputed > 0
    torch.testing.assert_close(
        first.cache.data[:, :, :, :end], second.cache.data[:, :, :, :end], rtol=0, atol=1e-6
    )
    later = first.layout.chunk_spans[2]
    assert not torch.equal(
        first.cache.data[-1, :, :, later[0] : later[1]][..., :4, :],
        second.cache.data[-1, :, :, later[0] : later[1]][..., :4, :],
    )


def test_epic_recomputes_first_tokens_of_each_chunk(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    result = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("epic"))
    assert [c.recomputed for c in result.chunks] == [min(4, c.tokens) for c in result.chunks]


def test_prefix_reuses_the_first_chunk_only(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    result = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("prefix"))
    assert result.chunks[0].recomputed == 0
    assert all(c.recomputed == c.tokens for c in result.chunks[1:])


def test_greedy_decode_from_full_reuse_equals_hugging_face_generate(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    result = tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=1.0, max_new_tokens=12
    )
    _, decoded = read_out(tiny_engine.generate(result, SamplingParams(max_new_tokens=12)))
    prompt = result.layout.token_tensor()[None]
    with torch.no_grad():
        reference = tiny_engine.loaded.model.generate(
            prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    expected = reference[0, prompt.shape[1] :].tolist()
    eos = set(tiny_engine.loaded.eos_token_ids)
    cut = next((i for i, t in enumerate(expected) if t in eos), len(expected))
    assert list(decoded.token_ids) == expected[:cut]


@pytest.mark.parametrize("selection", ["deviation", "question_weighted"])
def test_both_selections_equal_full_at_ratio_one_and_differ_below(tiny_loaded, tmp_path, selection):
    from engine import EngineConfig
    from engine.engine import Engine

    engine = Engine(
        EngineConfig(data_dir=tmp_path, selection=selection, fidelity="fast"), tiny_loaded
    )
    chunks = chunk_inputs(engine)
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    everything = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=1.0)
    torch.testing.assert_close(everything.logits, full.logits, rtol=1e-4, atol=1e-4)
    part = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.3)
    assert 0 < part.recomputed_tokens < part.context_tokens


def test_epic_recomputing_every_chunk_token_equals_full(tiny_engine):
    """EPIC's mechanism is exact: with k at least every chunk's length it is full prefill
    (so a worse KL than naive at small k is the partial state, not a defect)."""
    chunks = chunk_inputs(tiny_engine)
    longest = max(len(c.token_ids) for c in chunks)
    engine = Engine(
        EngineConfig(data_dir=tiny_engine.config.data_dir, epic_tokens=longest), tiny_engine.loaded
    )
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    epic = engine.prefill(
        chunks, QUESTION, mode=Mode.named("epic"), fidelity=Fidelity.named("fast")
    )
    assert epic.recompute_share == 1.0
    torch.testing.assert_close(epic.logits, full.logits, rtol=1e-4, atol=1e-4)
