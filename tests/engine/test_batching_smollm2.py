"""SmolLM2: greedy answers of every mode are token-for-token the same batched as alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

import engine.serving.scheduler as scheduler_module
from engine.engine import Engine
from engine.planners import planner_names
from tests.engine.batching import BUDGETS, StepRecorder, decode_alone, decode_joined
from tests.engine.helpers import chunk_inputs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(smol_engine):
    """The session's SmolLM2 engine (batching on, the default) and one decoding alone."""
    assert smol_engine.scheduler is not None
    alone = Engine(replace(smol_engine.config, batching=False), smol_engine.model_loaded)
    return smol_engine, alone


@pytest.mark.parametrize("mode", planner_names())
def test_greedy_answers_are_the_same_batched_as_alone(engines, mode, monkeypatch):
    batched, alone = engines
    steps = StepRecorder(scheduler_module.decode_batch)
    monkeypatch.setattr(scheduler_module, "decode_batch", steps)
    chunks = chunk_inputs(batched)
    expected = decode_alone(alone, chunks, mode)
    assert sum(map(len, expected)) >= sum(BUDGETS) // 2  # most steps are compared, not cut by EOS
    assert decode_joined(batched, chunks, mode, steps) == expected
    assert max(steps.sizes) >= 3
