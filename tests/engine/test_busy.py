"""Blend or not (engine/serving/busy.py): a balanced request skips a blend that would only be
re-run (idle) or re-run or repaired (busy), computes exactly after its exact prefix instead, and
the odds learn from every blended request's outcome."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig
from engine.config import Fidelity
from engine.decoding import read_out
from engine.engine import Engine
from engine.model.decode import SamplingParams
from engine.planners import Mode
from engine.serving.busy import EXPLORE_EVERY, BusyGate, RepairOdds
from tests.engine.helpers import QUESTION, chunk_inputs

TOKENS = 6


@pytest.fixture(scope="module")
def chunks(tiny_engine):
    return chunk_inputs(tiny_engine)


def engine_with(tiny_engine, **overrides) -> Engine:
    """A fresh engine (fresh odds) over the tiny model, first-token check off unless overridden."""
    # reuse profile off: balanced blends (no profile would make them exact-first)
    settings = dict(guard_margin=0.0, reuse_profile="off", batching=False, epic_tokens=4)
    settings.update(overrides)
    return Engine(
        EngineConfig(data_dir=tiny_engine.config.data_dir, **settings), tiny_engine.loaded
    )


def test_the_odds_start_even_and_follow_the_outcomes():
    odds = RepairOdds(window=4)
    assert odds.share == 0.5 and odds.count == 0
    for _ in range(3):
        odds.record(True)
    assert odds.share == pytest.approx(4 / 5)
    for _ in range(4):
        odds.record(False)  # the window forgets the repairs
    assert odds.count == 4 and odds.share == pytest.approx(1 / 6)


def test_the_gate_skips_only_when_busy_and_blends_are_mostly_repaired():
    gate = BusyGate()
    for _ in range(8):
        gate.odds.record(True)
    with gate.in_flight():
        assert not gate.skip_blend(0.7)  # alone: the blend buys TTFT
        with gate.in_flight():
            assert gate.others_in_flight() == 1
            assert gate.skip_blend(0.7)
            assert not gate.skip_blend(None)  # the setting off
            assert not gate.skip_blend(0.95)  # odds (9/10) below the threshold
    assert gate.others_in_flight() == 0 and gate.skipped == 1
    with gate.in_flight():
        assert gate.skip_blend(0.7, decoding=1)  # another request decoding counts as load
    assert gate.skipped == 2


def test_the_odds_tell_first_token_reruns_from_repairs():
    odds = RepairOdds(window=8)
    for _ in range(3):
        odds.record(True, at_first_token=True)
    for _ in range(3):
        odds.record(True)  # repaired while decoding
    odds.record(False, at_first_token=True)  # kept: never a re-run
    assert odds.share == pytest.approx(7 / 9) and odds.rerun_share == pytest.approx(4 / 9)


def test_idle_the_gate_skips_by_the_first_token_reruns_alone():
    gate = BusyGate()
    for _ in range(8):
        gate.odds.record(True, at_first_token=True)
    with gate.in_flight():  # alone: the re-runs would land in this request's TTFT
        assert gate.skip_blend(0.7) and gate.skipped == 1
    repaired = BusyGate()
    for _ in range(8):
        repaired.odds.record(True)  # repairs come after the first token: the blend buys TTFT
    with repaired.in_flight():
        assert not repaired.skip_blend(0.7)


def test_under_sustained_load_one_request_in_eight_blends_anyway():
    gate = BusyGate()
    for _ in range(8):
        gate.odds.record(True)
    with gate.in_flight(), gate.in_flight():
        decisions = [gate.skip_blend(0.5) for _ in range(3 * EXPLORE_EVERY)]
    assert decisions.count(False) == 3 and gate.skipped == 3 * (EXPLORE_EVERY - 1)
    assert not decisions[EXPLORE_EVERY - 1] and all(decisions[: EXPLORE_EVERY - 1])


def test_a_busy_engine_computes_exactly_instead_of_blending(tiny_engine, chunks):
    engine = engine_with(tiny_engine)
    for _ in range(4):
        engine.busy.odds.record(True)
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"), max_new_tokens=TOKENS)
    with engine.busy.in_flight():  # another request's prefill is in flight
        result = engine.prefill(
            chunks, QUESTION, mode=Mode.named("cacheblend"), max_new_tokens=TOKENS
        )
    guard = result.guard
    assert guard.skipped_blend and not guard.escalated and guard.margin is None
    assert result.watch is None and engine.busy.skipped == 1 and guard.outcome == "skipped"
    n = full.layout.total_len
    assert torch.allclose(result.logits, full.logits, atol=1e-4)
    assert torch.allclose(result.cache.data[:, :, :, :n], full.cache.data[:, :, :, :n], atol=1e-4)
    # the exact prefix (system prefix, first chunk's base variant) was reused, the rest computed
    exact_rows = full.layout.chunk_spans[0][1]
    assert int(result.layers_computed[:exact_rows].sum()) == 0
    assert bool((result.layers_computed[exact_rows:] == tiny_engine.loaded.spec.num_layers).all())
    assert engine.busy.odds.count == 4  # a skipped request teaches the odds nothing


def test_a_request_decoding_in_the_batch_makes_the_engine_busy(tiny_engine, chunks):
    engine = engine_with(tiny_engine, batching=True, guard_answer_margin=0.0)
    try:
        for _ in range(4):
            engine.busy.odds.record(True)
        first = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), max_new_tokens=64)
        assert not first.guard.skipped_blend  # nothing else was being served
        stream = engine.generate(first, SamplingParams(max_new_tokens=64))
        next(iter(stream))  # it decodes in the batch now
        second = engine.prefill(
            chunks, QUESTION, mode=Mode.named("cacheblend"), max_new_tokens=TOKENS
        )
        stream.close()
        assert second.guard.skipped_blend and second.watch is None
    finally:
        engine.close()


def test_a_request_served_from_exact_variants_has_no_blend_to_skip(tiny_engine, chunks):
    import dataclasses

    from app.variants.harvest import chunk_rows

    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    exact = [chunks[0]] + [
        dataclasses.replace(c, kv=chunk_rows(tiny_engine, full, i))
        for i, c in enumerate(chunks)
        if i
    ]
    engine = engine_with(tiny_engine)
    for _ in range(4):
        engine.busy.odds.record(True)
    with engine.busy.in_flight():
        result = engine.prefill(exact, QUESTION, mode=Mode.named("cachecraft"))
    assert (
        not result.guard.skipped_blend
        and result.guard.outcome == "exact"
        and engine.busy.skipped == 0
    )


@pytest.mark.parametrize("fidelity", ["fast", "exact"])
def test_only_balanced_requests_skip(tiny_engine, chunks, fidelity):
    engine = engine_with(tiny_engine)
    for _ in range(4):
        engine.busy.odds.record(True)
    with engine.busy.in_flight():
        result = engine.prefill(
            chunks, QUESTION, mode=Mode.named("cacheblend"), fidelity=Fidelity.named(fidelity)
        )
    assert not result.guard.skipped_blend and engine.busy.skipped == 0


def test_an_idle_engine_or_good_odds_keep_the_blend(tiny_engine, chunks):
    engine = engine_with(tiny_engine)
    for _ in range(4):
        engine.busy.odds.record(True)
    idle = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    assert not idle.guard.skipped_blend and idle.guard.margin is not None
    for _ in range(20):
        engine.busy.odds.record(False)
    with engine.busy.in_flight():
        busy = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    assert not busy.guard.skipped_blend and torch.equal(busy.logits, idle.logits)


def test_the_odds_learn_from_reruns_and_repairs_only(tiny_engine, chunks):
    params = SamplingParams(max_new_tokens=TOKENS)
    rerun = engine_with(tiny_engine, guard_margin=1e9)
    # known at once
    assert rerun.prefill(chunks, QUESTION, mode=Mode.named("cacheblend")).guard.outcome == "rerun"
    assert rerun.busy.odds.count == 1 and rerun.busy.odds.share == pytest.approx(2 / 3)
    repaired = engine_with(tiny_engine, guard_answer_margin=1e9)
    result = repaired.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), max_new_tokens=TOKENS
    )
    assert repaired.busy.odds.count == 0  # known only once the decode ends
    _, decoded = read_out(repaired.generate(result, params))
    assert decoded.guard.repaired_at is not None and repaired.busy.odds.share == pytest.approx(
        2 / 3
    )
    assert decoded.guard.outcome == "repaired" and result.guard.outcome == "kept"
    kept = engine_with(tiny_engine, guard_answer_margin=0.0)
    result = kept.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), max_new_tokens=TOKENS)
    _, decoded = read_out(kept.generate(result, params))
    assert kept.busy.odds.count == 1 and kept.busy.odds.share == pytest.approx(1 / 3)
    assert decoded.guard.outcome == "kept"
    for fidelity, mode in (("fast", "cacheblend"), ("balanced", "full")):
        result = kept.prefill(
            chunks,
            QUESTION,
            mode=Mode.named(mode),
            fidelity=Fidelity.named(fidelity),
            max_new_tokens=TOKENS,
        )
        "".join(kept.generate(result, params))
    assert kept.busy.odds.count == 1


def test_a_cancelled_decode_teaches_nothing(tiny_engine, chunks):
    engine = engine_with(tiny_engine, guard_answer_margin=0.0)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), max_new_tokens=TOKENS)
    stream = engine.generate(result, SamplingParams(max_new_tokens=TOKENS))
    next(iter(stream))
    stream.close()
    assert engine.busy.odds.count == 0


def test_config_and_settings_accept_the_threshold(tmp_path, monkeypatch):
    from app.settings import Settings

    with pytest.raises(ValueError, match="guard_busy_repair_share"):
        EngineConfig(guard_busy_repair_share=1.5)
    monkeypatch.setenv("KVMOSAIC_GUARD_BUSY_REPAIR_SHARE", "off")
    assert Settings(data_dir=tmp_path).guard_busy_repair_share is None
    monkeypatch.setenv("KVMOSAIC_GUARD_BUSY_REPAIR_SHARE", "0.5")
    assert Settings(data_dir=tmp_path).guard_busy_repair_share == 0.5
