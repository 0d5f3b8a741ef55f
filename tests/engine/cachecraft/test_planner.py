"""The cachecraft mode on the tiny model: exact limits, early termination, variants."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.variants.book import VariantBook
from app.variants.build import build_variants
from app.variants.harvest import source_contexts
from app.variants.policy import VariantPolicy
from engine.cachecraft.choice import Candidate, choose_variant
from engine.engine import Engine
from engine.plan import ChunkInput
from engine.planners import Mode
from engine.variant_stats import VariantStats
from tests.engine.helpers import QUESTION, chunk_inputs


@pytest.fixture
def engine(tiny_loaded, tmp_path):
    from engine import EngineConfig

    return Engine(EngineConfig(data_dir=tmp_path, focus_layer=None, fidelity="fast"), tiny_loaded)


def with_stats(chunks, context=(999,), cci=0.8) -> list[ChunkInput]:
    """Chunks whose variant claims statistics measured after `context`."""
    out = []
    for chunk in chunks:
        n = len(chunk.token_ids)
        stats = VariantStats(
            a=0.1,
            b=0.1,
            cci=cci,
            inter_scores={c: 1.0 for c in context},
            token_scores=[float((7 * t) % n) for t in range(n)],
        )
        kv = dataclasses.replace(chunk.kv, context=tuple(context))
        out.append(ChunkInput(chunk.chunk_id, chunk.token_ids, kv, stats))
    return out


def configured(engine, **changes):
    engine.config = dataclasses.replace(engine.config, **changes)
    return engine


def test_alpha_zero_equals_naive(engine):
    chunks = with_stats(chunk_inputs(engine))
    configured(engine, craft_alpha=0.0)
    craft = engine.prefill(chunks, QUESTION, mode=Mode.named("cachecraft"))
    naive = engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    assert torch.equal(craft.logits, naive.logits)
    assert craft.recomputed_tokens == 0
    assert {c.strategy for c in craft.chunks} == {"reuse"}


def test_cfo_forced_to_one_equals_full(engine):
    chunks = with_stats(chunk_inputs(engine))
    configured(engine, craft_alpha=100.0)
    craft = engine.prefill(chunks, QUESTION, mode=Mode.named("cachecraft"))
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    torch.testing.assert_close(craft.logits, full.logits, rtol=1e-4, atol=1e-4)
    assert {c.strategy for c in craft.chunks} == {"full"} and all(
        c.cfo == 1.0 for c in craft.chunks
    )


def test_partial_recomputes_the_highest_scored_tokens(engine):
    chunks = with_stats(chunk_inputs(engine))
    configured(engine, craft_alpha=0.3, craft_novelty=False)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("cachecraft"))
    for chunk, report in zip(chunks, result.chunks):
        assert report.strategy == "partial" and report.cfo == pytest.approx(0.3 * 0.8)
        scores = chunk.stats.token_scores
        picked = set(report.recomputed_offsets)
        assert len(picked) == -(-len(scores) * 24 // 100)
        assert min(scores[t] for t in picked) >= max(
            scores[t] for t in range(len(scores)) if t not in picked
        )


def test_base_variant_without_statistics_is_planned_by_deviation(engine):
    chunks = chunk_inputs(engine)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("cachecraft"), ratio=0.3)
    strategies = [c.strategy for c in result.chunks]
    assert strategies[0] == "reuse"  # alone after the prefix, exactly as cached
    assert set(strategies[1:]) == {"deviation"}


def test_unfocused_chunk_stops_changing_after_its_termination_layer(engine):
    chunks = with_stats(chunk_inputs(engine))
    # every chunk unfocused
    configured(engine, craft_alpha=100.0, focus_layer=2, focus_threshold=100.0)
    craft = engine.prefill(chunks, QUESTION, mode=Mode.named("cachecraft"))
    naive = engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    for i, (report, (start, end)) in enumerate(zip(craft.chunks, craft.layout.chunk_spans)):
        assert report.stopped_layer == 2 and report.recomputed == report.tokens
        rows = slice(start, end)
        # layers 0..2 were recomputed in context (the first chunk's context is the prefix alone,
        # as for its base KV, so only later chunks change); above, the cached KV is used as is
        if i:
            assert not torch.allclose(
                craft.cache.data[2, :, :, rows], naive.cache.data[2, :, :, rows]
            )
        assert torch.equal(craft.cache.data[3:, :, :, rows], naive.cache.data[3:, :, :, rows])


def test_focused_chunks_keep_recomputing(engine):
    chunks = with_stats(chunk_inputs(engine))
    configured(engine, craft_alpha=100.0, focus_layer=2, focus_threshold=0.0)
    craft = engine.prefill(chunks, QUESTION, mode=Mode.named("cachecraft"))
    assert all(c.stopped_layer is None for c in craft.chunks)


def test_exact_variants_from_a_request_equal_full_prefill_rows(engine):
    chunks = chunk_inputs(engine)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("cachecraft"))
    drafts = build_variants(
        engine, result, source_contexts(chunks), VariantPolicy(engine.config, 2)
    ).drafts
    assert [d.chunk_id for d in drafts] == [c.chunk_id for c in chunks[1:]]
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    for i, (draft, (start, end)) in enumerate(zip(drafts, full.layout.chunk_spans[1:]), start=1):
        assert draft.kv.context == tuple(c.chunk_id for c in chunks[:i])
        torch.testing.assert_close(draft.kv.kv, full.cache.rows(start, end), rtol=1e-4, atol=1e-4)
        stats = draft.stats
        assert 0.5 <= stats.cci < 1.0 and len(stats.token_scores) == end - start
        assert set(stats.inter_scores) == set(draft.kv.context)


def test_book_picks_the_variant_of_this_exact_context(engine):
    book = VariantBook(engine)
    chunks = chunk_inputs(engine)
    for chunk in chunks:
        book.add(chunk.chunk_id, chunk.kv)
    ids = [c.chunk_id for c in chunks]
    for _ in range(2):  # the second time this chunk set comes, its exact variants are built
        inputs = book.inputs(ids, Mode.named("cachecraft"))
        book.record(engine.prefill(inputs, QUESTION, mode=Mode.named("cachecraft")), inputs)
    assert all(book.num_variants(i) == 2 for i in ids[1:])
    again = engine.prefill(
        book.inputs(ids, Mode.named("cachecraft")), QUESTION, mode=Mode.named("cachecraft")
    )
    assert [c.strategy for c in again.chunks] == ["reuse"] * len(ids)
    assert [c.cfo for c in again.chunks] == [0.0] * len(ids)
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    torch.testing.assert_close(again.logits, full.logits, rtol=1e-4, atol=1e-4)


def test_book_keeps_at_most_max_variants_and_always_the_base(engine):
    book = VariantBook(engine, max_variants=2)
    chunks = chunk_inputs(engine)
    for chunk in chunks:
        book.add(chunk.chunk_id, chunk.kv)
    ids = [c.chunk_id for c in chunks]
    for order in (ids, ids[::-1], ids[1:] + ids[:1], ids[2:] + ids[:2]):
        inputs = book.inputs(order, Mode.named("cachecraft"))
        book.record(engine.prefill(inputs, QUESTION, mode=Mode.named("cachecraft")), inputs)
    assert book.build_work  # the same set came back: variants were built
    assert all(book.num_variants(i) <= 2 for i in ids)
    assert all(any(not e.kv.context for e in book._variants[i]) for i in ids)


def test_choice_prefers_lowest_cfo_and_falls_back_to_base():
    stats = VariantStats(cci=0.8, inter_scores={"a": 1.0, "b": 1.0})
    candidates = [Candidate(()), Candidate(("a", "b"), stats), Candidate(("b", "a"), stats)]
    assert choose_variant(candidates, ("a", "b"), 1.0) == (1, 0.0)
    index, value = choose_variant(candidates, ("b", "a"), 1.0)
    assert index == 2 and value == 0.0
    assert choose_variant([Candidate(()), Candidate(("x",))], ("a",), 1.0) == (0, None)
