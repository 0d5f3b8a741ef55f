"""Query-centric focus (engine/planners/focus.py): a probe of the question's attention over the
reused chunks picks context rows that the blend recomputes from layer 0."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.plan import PlanRequest
from engine.planners import Mode
from engine.planners.focus import focus_mask, wants_focus
from tests.engine.helpers import QUESTION, chunk_inputs, plan_request

BLENDS = ("cacheblend", "cachecraft")


def request(engine, chunks, **settings) -> PlanRequest:
    return plan_request(engine, chunks, dataclasses.replace(engine.config, **settings))


def test_the_mask_holds_the_top_chunks_and_rows_of_the_context_only(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    one = request(tiny_engine, chunks, focus_probe_layer=1, focus_chunks=1)
    assert wants_focus(one)
    mask = focus_mask(tiny_engine.runner, one)
    spans = one.layout.chunk_spans
    whole = [i for i, (a, b) in enumerate(spans) if bool(mask[a:b].all())]
    assert len(whole) == 1 and int(mask.sum()) == spans[whole[0]][1] - spans[whole[0]][0]
    rows = request(tiny_engine, chunks, focus_probe_layer=1, focus_rows=0.25)
    picked = focus_mask(tiny_engine.runner, rows)
    context = rows.context_mask()
    assert int(picked.sum()) == -(-int(context.sum()) // 4) and not bool((picked & ~context).any())


def test_no_probe_unless_asked_or_with_nothing_reused(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    assert not wants_focus(request(tiny_engine, chunks))  # off by default
    assert not wants_focus(request(tiny_engine, chunks, focus_probe_layer=1))  # nothing to pick
    plain = [dataclasses.replace(c, kv=None) for c in chunks]
    assert not wants_focus(request(tiny_engine, plain, focus_probe_layer=1, focus_chunks=1))


@pytest.mark.parametrize("mode", BLENDS)
def test_a_focused_chunk_runs_every_layer_and_the_probe_is_charged(tiny_engine, mode):
    chunks = chunk_inputs(tiny_engine)
    layers = tiny_engine.loaded.spec.num_layers
    config = dataclasses.replace(
        tiny_engine.config, focus_probe_layer=1, focus_chunks=1, focus_layer=None
    )
    meter = tiny_engine.runner.meter
    before = meter.snapshot()
    result = tiny_engine.prefill(chunks, QUESTION, Mode.named(mode), ratio=0.0, config=config)
    spans = result.layout.chunk_spans
    computed = result.layers_computed
    whole = [i for i, (a, b) in enumerate(spans) if bool((computed[a:b] == layers).all())]
    assert len(whole) == 1  # the focused chunk; at ratio 0 the others are reused
    question = result.layout.question_span
    probe_rows = (question[1] - question[0]) * 2  # the question's rows, layers 0 and 1
    assert meter.snapshot().layer_rows - before.layer_rows == int(computed.sum()) + probe_rows


@pytest.mark.parametrize("mode", BLENDS)
def test_focus_on_every_row_is_full_prefill(tiny_engine, mode):
    chunks = chunk_inputs(tiny_engine)
    config = dataclasses.replace(tiny_engine.config, focus_probe_layer=1, focus_rows=1.0)
    full = tiny_engine.prefill(chunks, QUESTION, Mode.named("full"))
    result = tiny_engine.prefill(chunks, QUESTION, Mode.named(mode), ratio=0.0, config=config)
    torch.testing.assert_close(result.logits, full.logits, rtol=1e-4, atol=1e-4)


def test_the_config_bounds_the_focus_settings():
    with pytest.raises(ValueError, match="focus_rows"):
        EngineConfig(focus_rows=1.5)
    with pytest.raises(ValueError, match="focus_chunks"):
        EngineConfig(focus_chunks=-1)
