"""The balanced guard while decoding (engine.serving.guard.AnswerWatch) on the tiny model: where it
fires the rest of the answer comes from the exact state; where it does not, nothing changes."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from bench.fidelity.metrics import forced_logits, guarded_logits, teacher_forced
from engine import EngineConfig
from engine.config import Fidelity
from engine.decoding import Decoded, read_out
from engine.engine import Engine
from engine.model.decode import SamplingParams, ended_by
from engine.planners import Mode
from engine.result import PrefillResult
from engine.serving.guard import AnswerWatch, first_repair, first_token_margin
from tests.engine.helpers import QUESTION, chunk_inputs

TOKENS = 8


@pytest.fixture(scope="module")
def chunks(tiny_engine):
    return chunk_inputs(tiny_engine)


def engine_with(tiny_engine, batching: bool = False, **overrides) -> Engine:
    """Another engine over the tiny model: balanced, the first-token check and the grounding
    check off unless overridden (the margin's repairs alone: tests/engine/test_grounding.py)."""
    # reuse profile off: balanced blends (no profile would make them exact-first)
    settings = dict(
        guard_margin=0.0,
        reuse_profile="off",
        batching=batching,
        epic_tokens=4,
        guard_grounding=False,
    )
    settings.update(overrides)
    return Engine(
        EngineConfig(data_dir=tiny_engine.config.data_dir, **settings), tiny_engine.loaded
    )


class Answered(NamedTuple):
    """A request's prefill and the record of its decode."""

    result: PrefillResult
    decoded: Decoded


def answer(
    engine: Engine,
    chunks,
    mode: str = "cacheblend",
    fidelity: str | None = None,
    params: SamplingParams = SamplingParams(max_new_tokens=TOKENS),
) -> Answered:
    result = engine.prefill(
        chunks,
        QUESTION,
        mode=Mode.named(mode),
        max_new_tokens=params.max_new_tokens,
        fidelity=Fidelity.named(fidelity) if fidelity else None,
    )
    return Answered(result, read_out(engine.generate(result, params))[1])


def test_the_check_fires_at_the_first_low_margin_inside_its_window():
    watch = AnswerWatch(threshold=1.0, window=4)
    confident, unsure = torch.tensor([5.0, 0.0, 0.0]), torch.tensor([0.5, 0.0, 0.0])
    assert watch.fired(0, unsure) is None  # the first token was judged at prefill
    assert watch.fired(1, confident) is None
    fired = watch.fired(2, unsure)
    assert fired is not None and fired.at == 2
    assert fired.margin == pytest.approx(first_token_margin(unsure))
    assert watch.fired(4, unsure) is None  # outside the window
    assert first_repair([0.1, 3.0, 0.2, 0.1], watch) == 2
    assert first_repair([0.1, 3.0, 3.0, 3.0, 0.1], watch) is None  # past the window


@pytest.mark.parametrize("batching", [False, True])
def test_a_fired_check_goes_on_from_the_exact_state(tiny_engine, chunks, batching):
    engine = engine_with(tiny_engine, batching=batching, guard_answer_margin=1e9)
    try:
        result, decoded = answer(engine, chunks)
    finally:
        engine.close()
    guard = decoded.guard
    assert guard.repaired_at == 1 and guard.repair_s > 0 and guard.repair_margin < 1e9
    assert result.guard.repaired_at is None  # the prefill's own record is never changed
    ids = list(decoded.token_ids)
    assert len(ids) >= 2  # the tiny model's EOS never wins a greedy pick here
    # the cache decoding went on from is full's prefill of the prompt plus the first answer token
    full = tiny_engine.prefill(
        chunks, QUESTION + "", mode=Mode.named("full"), max_new_tokens=TOKENS
    )
    n = full.layout.total_len
    assert torch.allclose(decoded.cache.data[:, :, :, :n], full.cache.data[:, :, :, :n], atol=1e-4)
    assert decoded.repair is not None and decoded.cache is decoded.repair.cache
    assert not torch.allclose(
        result.cache.data[:, :, :, :n], full.cache.data[:, :, :, :n], atol=1e-4
    )
    # the repair reused the exact rows (system prefix, first chunk: its base variant is exact
    # there) and computed every later row, the first answer token's included, through every layer
    exact_rows = full.layout.chunk_spans[0][1]
    layers = decoded.repair.layers_computed
    assert layers.numel() == n + 1 and int(layers[:exact_rows].sum()) == 0
    assert bool((layers[exact_rows:] == tiny_engine.loaded.spec.num_layers).all())
    # and the tokens after the repair are the greedy ones of that exact state
    expected = forced_logits(tiny_engine, full, ids)[1:].argmax(-1).tolist()
    assert ids[1:] == expected[: len(ids) - 1]


def test_a_silent_check_changes_nothing(tiny_engine, chunks):
    watched = answer(engine_with(tiny_engine, guard_answer_margin=0.0), chunks)
    fast = answer(tiny_engine, chunks, fidelity="fast")
    assert watched.result.watch is not None and watched.decoded.guard.repaired_at is None
    assert watched.decoded.token_ids == fast.decoded.token_ids and not watched.decoded.repaired
    assert watched.decoded.cache is watched.result.cache


@pytest.mark.parametrize(
    "mode,fidelity",
    [("cacheblend", "fast"), ("cacheblend", "exact"), ("full", None), ("prefix", None)],
)
def test_only_balanced_inexact_prefills_are_watched(tiny_engine, chunks, mode, fidelity):
    result, decoded = answer(
        engine_with(tiny_engine, guard_answer_margin=1e9), chunks, mode=mode, fidelity=fidelity
    )
    assert result.watch is None and decoded.guard.repaired_at is None


def test_an_escalated_prefill_is_not_watched(tiny_engine, chunks):
    result, decoded = answer(
        engine_with(tiny_engine, guard_margin=1e9, guard_answer_margin=1e9), chunks
    )
    assert result.guard.escalated and result.watch is None and decoded.guard.repaired_at is None


def test_a_zero_window_turns_the_check_off(tiny_engine, chunks):
    result, _ = answer(
        engine_with(tiny_engine, guard_answer_margin=1e9, guard_answer_tokens=1), chunks
    )
    assert result.watch is None


@pytest.mark.parametrize("batching", [False, True])
def test_a_seeded_sample_is_repeatable_through_a_repair(tiny_engine, chunks, batching):
    params = SamplingParams(max_new_tokens=TOKENS, temperature=1.0, seed=7)
    engine = engine_with(tiny_engine, batching=batching, guard_answer_margin=1e9)
    try:
        first, second = answer(engine, chunks, params=params), answer(engine, chunks, params=params)
    finally:
        engine.close()
    assert first.decoded.guard.repaired_at == 1
    assert first.decoded.token_ids == second.decoded.token_ids


@pytest.mark.parametrize("batching", [False, True])
def test_closing_the_stream_after_a_repair_cancels_it(tiny_engine, chunks, batching):
    engine = engine_with(tiny_engine, batching=batching, guard_answer_margin=1e9)
    try:
        result = engine.prefill(
            chunks, QUESTION, mode=Mode.named("cacheblend"), max_new_tokens=TOKENS
        )
        stream = engine.generate(result, SamplingParams(max_new_tokens=TOKENS))
        pieces = [next(stream), next(stream)]  # the second piece comes from the repaired state
        stream.close()
        decoded = stream.decoded()
        assert pieces and decoded.guard.repaired_at == 1
        assert len(decoded.token_ids) < TOKENS
    finally:
        engine.close()


def test_teacher_forcing_follows_the_guard(tiny_engine, chunks):
    engine = engine_with(tiny_engine, guard_answer_margin=1e9)
    full, full_decoded = answer(tiny_engine, chunks, mode="full")
    ids = list(full_decoded.token_ids)
    reference = forced_logits(tiny_engine, full, ids)
    result, _ = answer(engine, chunks)
    own = forced_logits(
        tiny_engine, result, ids
    )  # the mode's own state, though decoding was repaired
    assert not torch.allclose(own[1:], reference[1:], atol=1e-3)
    guarded = guarded_logits(result, own, reference)
    assert torch.equal(guarded[0], own[0]) and torch.equal(guarded[1:], reference[1:])
    score = teacher_forced(tiny_engine, result, ids, reference)
    assert score.top1_share == pytest.approx(
        float((guarded.argmax(-1) == torch.tensor(ids)).double().mean())
    )
    fast, _ = answer(tiny_engine, chunks, fidelity="fast")
    assert guarded_logits(fast, own, reference) is own  # an unwatched result keeps its own logits


def test_a_repaired_request_leaves_every_chunk_exact(tiny_engine, chunks):
    from app.variants.harvest import exact_chunks, harvest, source_contexts

    layers = tiny_engine.loaded.spec.num_layers
    result, decoded = answer(
        engine_with(tiny_engine, guard_answer_margin=1e9), chunks, mode="cachecraft"
    )
    assert decoded.repaired
    assert exact_chunks(result, source_contexts(chunks), layers, decoded) == [True] * len(chunks)
    assert exact_chunks(result, source_contexts(chunks), layers) != [True] * len(chunks)
    kept = harvest(tiny_engine, result, chunks, decoded)
    assert [chunk_id for chunk_id, _ in kept] == [
        c.chunk_id for c in chunks[1:]
    ]  # the first was exact already
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    for chunk_id, kv in kept:
        start, end = full.layout.chunk_spans[chunk_id]
        assert torch.allclose(kv.kv, full.cache.rows(start, end), atol=1e-4)


def test_a_prefill_from_exact_variants_is_neither_rerun_nor_watched(tiny_engine, chunks):
    import dataclasses

    from app.variants.harvest import chunk_rows

    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    exact = [chunks[0]] + [
        dataclasses.replace(c, kv=chunk_rows(tiny_engine, full, i))
        for i, c in enumerate(chunks)
        if i > 0
    ]
    engine = engine_with(tiny_engine, guard_margin=1e9, guard_answer_margin=1e9)
    result, _ = answer(engine, exact, mode="cachecraft")
    assert not result.guard.escalated and result.guard.margin is None and result.watch is None
    assert result.recompute_share == 0.0
    assert torch.allclose(result.logits, full.logits, atol=1e-3)
    one_blended, _ = answer(engine, exact[:2] + chunks[2:], mode="cachecraft")
    # a chunk from another context: the state is inexact, the guard acts
    assert one_blended.guard.escalated


def _exact_variants(tiny_engine, chunks):
    import dataclasses

    from app.variants.harvest import chunk_rows

    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    return full, [chunks[0]] + [
        dataclasses.replace(c, kv=chunk_rows(tiny_engine, full, i))
        for i, c in enumerate(chunks)
        if i > 0
    ]


def test_a_short_tail_after_exact_chunks_is_computed_fully_and_the_state_is_exact(
    tiny_engine, chunks
):
    from app.variants.harvest import exact_chunks, source_contexts

    full, exact = _exact_variants(tiny_engine, chunks)
    mixed = exact[:-1] + chunks[-1:]  # the last chunk's base variant: not exact after the others
    spans = full.layout.chunk_spans
    share = (spans[-1][1] - spans[-1][0]) / (spans[-1][1] - spans[0][0])
    engine = engine_with(
        tiny_engine, guard_margin=1e9, guard_answer_margin=1e9, craft_exact_tail=share
    )
    result, decoded = answer(engine, mixed, mode="cachecraft")
    assert [c.strategy for c in result.chunks] == ["reuse"] * (len(chunks) - 1) + ["tail"]
    assert not result.guard.escalated and result.guard.margin is None and result.watch is None
    assert not decoded.repaired
    assert torch.allclose(result.logits, full.logits, atol=1e-3)
    assert exact_chunks(result, source_contexts(mixed), tiny_engine.loaded.spec.num_layers) == [
        True
    ] * len(chunks)
    # just over the limit, or at `fast`: the tail is blended, so the balanced guard acts
    over = engine_with(
        tiny_engine, guard_margin=1e9, guard_answer_margin=1e9, craft_exact_tail=share * 0.99
    )
    assert answer(over, mixed, mode="cachecraft").result.guard.escalated
    fast, _ = answer(engine, mixed, mode="cachecraft", fidelity="fast")
    assert fast.guard.margin is not None and fast.recompute_share < result.recompute_share


def test_no_exact_tail_without_a_leading_exact_chunk_or_when_off(tiny_engine, chunks):
    from engine.plan import PlanRequest
    from engine.planners.cachecraft import exact_tail_start

    full, exact = _exact_variants(tiny_engine, chunks)

    def start(inputs, fidelity="balanced", share=1.0):
        config = EngineConfig(data_dir=tiny_engine.config.data_dir, craft_exact_tail=share)
        layout = tiny_engine.prompts.layout([tuple(c.token_ids) for c in inputs], QUESTION)
        return exact_tail_start(
            PlanRequest(
                layout,
                tuple(inputs),
                tiny_engine.prefix_kv,
                0.15,
                config,
                tiny_engine.loaded.spec.num_layers,
                Fidelity.named(fidelity),
            )
        )

    assert start(exact[:-1] + chunks[-1:]) == len(chunks) - 1
    assert start(exact) is None  # every chunk exact already: nothing to compute
    assert (
        start(exact[1:2] + chunks[:1]) is None
    )  # a first chunk computed after another one: no lead
    assert start(exact[:-1] + chunks[-1:], fidelity="fast") is None
    assert start(exact[:-1] + chunks[-1:], share=0.0) is None


def test_a_lossy_copy_of_exact_variants_is_checked_and_re_run_not_taken_for_exact(
    tiny_engine, chunks
):
    """A context variant read back through a lossy store codec is close to exact, not exact:
    the guard must judge it (and here re-run it), and a harvest returns its exact rows."""
    import dataclasses

    from app.store.entry import roundtrip
    from app.variants.harvest import exact_chunks, harvest, source_contexts

    full, exact = _exact_variants(tiny_engine, chunks)
    lossy = [dataclasses.replace(c, kv=roundtrip(c.kv, "int8")) for c in exact]
    assert all(c.kv.value_rounding is not None for c in lossy)
    layers = tiny_engine.loaded.spec.num_layers
    engine = engine_with(
        tiny_engine, guard_margin=1e9, guard_answer_margin=1e9
    )  # escalate whenever asked
    as_stored, _ = answer(engine, exact, mode="cachecraft")
    assert as_stored.guard.margin is None and not as_stored.guard.escalated  # exact: never judged
    rounded, _ = answer(engine, lossy, mode="cachecraft")
    assert rounded.guard.margin is not None and rounded.guard.escalated
    assert "tail" not in [c.strategy for c in rounded.chunks]  # no exact lead to start a tail after
    assert torch.allclose(rounded.logits, full.logits, atol=1e-3)  # the re-run is full prefill's
    assert exact_chunks(rounded, source_contexts(lossy), layers) == [True] * len(chunks)
    # every chunk: exact now, where it had loaded a lossy copy (the service may keep a float one)
    kept = harvest(engine, rounded, lossy)
    assert [chunk_id for chunk_id, _ in kept] == [c.chunk_id for c in lossy]
    assert all(torch.allclose(kv.kv, c.kv.kv, atol=1e-3) for (_, kv), c in zip(kept[1:], exact[1:]))
    assert harvest(engine, as_stored, exact) == []  # exact sources: nothing new
    blended = engine.prefill(
        lossy, QUESTION, mode=Mode.named("cachecraft"), fidelity=Fidelity.named("fast")
    )
    assert exact_chunks(blended, source_contexts(lossy), layers) == [False] * len(chunks)


def test_prefix_over_a_lossy_prefix_is_judged_and_over_a_float_one_is_not(tiny_engine, chunks):
    import dataclasses

    from app.store.entry import roundtrip

    engine = engine_with(tiny_engine, guard_margin=1e9, guard_answer_margin=1e9)
    as_computed = engine.prefill(chunks, QUESTION, mode=Mode.named("prefix"))
    assert as_computed.guard.margin is None and not as_computed.guard.escalated
    lossy = [dataclasses.replace(c, kv=roundtrip(c.kv, "int8")) for c in chunks]
    rounded = engine.prefill(lossy, QUESTION, mode=Mode.named("prefix"))
    assert rounded.guard.margin is not None and rounded.guard.escalated
    assert torch.allclose(rounded.logits, as_computed.logits, atol=1e-3)  # re-run: the reference's


@pytest.mark.parametrize("batching", [False, True])
def test_the_checks_verdict_comes_back_through_the_streams_end(tiny_engine, chunks, batching):
    engine = engine_with(tiny_engine, batching=batching)
    try:
        result = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
        watch = AnswerWatch(threshold=1e9, window=4)  # fires at the first step it watches
        ids = engine.decode_ids(result.cache, result.logits, SamplingParams(), watch, None)
        assert next(ids) is not None  # step 0 is never watched
        with pytest.raises(StopIteration) as end:
            next(ids)
        fired = ended_by(end.value)
        assert fired is not None and fired.at == 1 and fired.margin < 1e9
    finally:
        engine.close()
