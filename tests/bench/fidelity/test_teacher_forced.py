"""Teacher-forced answer fidelity (bench/fidelity/metrics.py) on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from bench.fidelity.metrics import forced_logits, teacher_forced
from engine.config import Fidelity
from engine.decoding import read_out
from engine.model.decode import SamplingParams, decode_step
from engine.planners import Mode
from tests.engine.helpers import QUESTION, chunk_inputs

ANSWER_TOKENS = 8


@pytest.fixture(scope="module")
def chunks(tiny_engine):
    return chunk_inputs(tiny_engine)


def greedy(engine, chunks, mode):
    """A prefill by `mode` and its greedy answer ids (the prefill's cache then holds them)."""
    result = engine.prefill(
        chunks,
        QUESTION,
        mode=Mode.named(mode),
        max_new_tokens=ANSWER_TOKENS + 1,
        fidelity=Fidelity.named("fast"),
    )
    _, decoded = read_out(engine.generate(result, SamplingParams(max_new_tokens=ANSWER_TOKENS)))
    return result, list(decoded.token_ids)


def test_forced_logits_equal_step_by_step_decoding(tiny_engine, chunks):
    result, ids = greedy(tiny_engine, chunks, "full")
    assert len(ids) >= 2
    forced = forced_logits(tiny_engine, result, ids)
    assert forced.shape == (len(ids), result.logits.numel())
    fresh = tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named("full"), max_new_tokens=ANSWER_TOKENS + 1
    )
    stepped = [fresh.logits]
    for token in ids[:-1]:
        stepped.append(decode_step(tiny_engine.stack, fresh.cache, token))
    torch.testing.assert_close(forced, torch.stack(stepped).cpu(), rtol=1e-4, atol=1e-4)


def test_full_follows_its_own_answer_exactly(tiny_engine, chunks):
    result, ids = greedy(tiny_engine, chunks, "full")
    reference = forced_logits(tiny_engine, result, ids)
    again, _ = greedy(tiny_engine, chunks, "full")
    score = teacher_forced(tiny_engine, again, ids, reference)
    assert score.positions == len(ids) and score.top1_share == 1.0
    assert score.mean_kl == pytest.approx(0.0, abs=1e-6)


def test_a_reuse_mode_is_measured_against_the_reference(tiny_engine, chunks):
    full, ids = greedy(tiny_engine, chunks, "full")
    reference = forced_logits(tiny_engine, full, ids)
    naive, _ = greedy(tiny_engine, chunks, "naive")
    score = teacher_forced(tiny_engine, naive, ids, reference)
    assert 0.0 <= score.top1_share <= 1.0 and score.mean_kl > 1e-6
    without_kl = teacher_forced(tiny_engine, naive, ids)
    assert without_kl.top1_share == score.top1_share and math.isnan(without_kl.mean_kl)


def test_edge_cases_are_clear(tiny_engine, chunks):
    result, ids = greedy(tiny_engine, chunks, "full")
    empty = teacher_forced(tiny_engine, result, [])
    assert empty.positions == 0 and math.isnan(empty.top1_share)
    with pytest.raises(ValueError, match="do not fit"):
        forced_logits(tiny_engine, result, ids * 10)
    with pytest.raises(ValueError, match="do not match"):
        teacher_forced(tiny_engine, result, ids, torch.zeros(len(ids) + 1, result.logits.numel()))
