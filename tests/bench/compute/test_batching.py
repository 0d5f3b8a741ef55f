"""The batching benchmark runs both ways on the tiny model and finds the same answers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.compute.batching import QUESTIONS, builtin_prompts, dataset_prompts, measure
from bench.fidelity.fidelity import load_dataset
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.planners import Mode
from tests.conftest import MUSIQUE_SLICE


def test_measure_compares_batching_on_and_off(tiny_engine):
    off = Engine(replace(tiny_engine.config, batching=False), tiny_engine.model_loaded)
    prompts = builtin_prompts(tiny_engine, 3)
    figures = measure(
        tiny_engine, off, prompts, concurrency=3, max_tokens=5, mode=Mode.named("naive"), rounds=1
    )
    assert figures["same_answers"] is True
    assert figures["on"]["decode_tokens"] == figures["off"]["decode_tokens"] == 3 * 4
    for key in ("decode_speedup", "decode_cpu_speedup", "ttft_p95_ratio"):
        assert figures[key] > 0


def test_builtin_prompts_rotate_the_passages_and_the_questions(tiny_engine):
    prompts = builtin_prompts(tiny_engine, 3)
    assert [question for _, question in prompts] == QUESTIONS[:3]
    firsts = [chunks[0].chunk_id for chunks, _ in prompts]
    assert firsts == [0, 1, 2] and all(len(chunks) == len(prompts[0][0]) for chunks, _ in prompts)


def test_dataset_prompts_take_each_record_s_question_and_first_passages(tiny_engine):
    records = load_dataset(MUSIQUE_SLICE)
    prompts = dataset_prompts(tiny_engine, records, 1, 2, chunks=3)
    assert [question for _, question in prompts] == [records[1]["question"], records[2]["question"]]
    for (chunks, _), record in zip(prompts, records[1:3]):
        assert [c.token_ids for c in chunks] == [
            tiny_engine.chunk_ids(ctx["text"], ctx.get("title", "")) for ctx in record["ctxs"][:3]
        ]
        assert all(c.kv is not None for c in chunks)
    with pytest.raises(InvalidRequest, match="records"):
        dataset_prompts(tiny_engine, records, len(records) - 1, 2, chunks=3)
