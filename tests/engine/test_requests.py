"""Bad input gets a clear exception; a failed RoPE self-check refuses reuse and falls back to
full."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, InvalidRequest, PromptTooLong, UnknownMode
from engine.decoding import read_out
from engine.engine import Engine
from engine.kv import ChunkKV
from engine.model.decode import SamplingParams, pick_token
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import QUESTION, chunk_inputs

CACHEBLEND = Mode.named("cacheblend")


def test_no_chunks_is_refused(tiny_engine):
    with pytest.raises(InvalidRequest, match="no chunks"):
        tiny_engine.prefill([], QUESTION, CACHEBLEND)


@pytest.mark.parametrize("question", ["", "   \n"])
def test_empty_question_is_refused(tiny_engine, question):
    with pytest.raises(InvalidRequest, match="question is empty"):
        tiny_engine.prefill(chunk_inputs(tiny_engine, cached=False), question, CACHEBLEND)


def test_unknown_mode_is_refused(tiny_engine):
    with pytest.raises(UnknownMode, match="known modes: full"):
        Mode.named("turbo")


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_ratio_outside_unit_interval_is_refused(tiny_engine, ratio):
    with pytest.raises(InvalidRequest, match=r"ratio must lie in \[0, 1\]"):
        tiny_engine.prefill(
            chunk_inputs(tiny_engine, cached=False), QUESTION, CACHEBLEND, ratio=ratio
        )


def test_prompt_longer_than_context_is_refused(tiny_engine):
    long_chunk = ChunkInput(0, tuple([100] * tiny_engine.loaded.spec.max_positions))
    with pytest.raises(PromptTooLong, match="exceeds the model's context"):
        tiny_engine.prefill([long_chunk], QUESTION, mode=Mode.named("full"))


def test_prompt_plus_new_tokens_must_fit(tiny_engine):
    room = tiny_engine.loaded.spec.max_positions - 200
    chunk = ChunkInput(0, tuple([100] * room))
    with pytest.raises(PromptTooLong):
        tiny_engine.prefill([chunk], QUESTION, mode=Mode.named("full"), max_new_tokens=400)


def test_kv_of_another_model_is_refused(tiny_engine):
    chunk = chunk_inputs(tiny_engine)[0]
    kv = chunk.kv
    foreign = ChunkKV(kv.token_ids, kv.kv, kv.base_position, "0" * 16, kv.prefix_digest)
    with pytest.raises(InvalidRequest, match="another model"):
        tiny_engine.prefill([ChunkInput(0, chunk.token_ids, foreign)], QUESTION, CACHEBLEND)


def test_kv_with_wrong_row_count_is_refused(tiny_engine):
    chunk = chunk_inputs(tiny_engine)[0]
    with pytest.raises(InvalidRequest, match="rows"):
        tiny_engine.prefill([ChunkInput(0, chunk.token_ids[:-1], chunk.kv)], QUESTION, CACHEBLEND)


@pytest.mark.parametrize(
    "params", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0)]
)
def test_bad_sampling_parameters_are_refused(params):
    with pytest.raises(InvalidRequest):
        SamplingParams(**params)


def test_a_result_decodes_once(tiny_engine):
    result = tiny_engine.prefill(chunk_inputs(tiny_engine), QUESTION, CACHEBLEND, max_new_tokens=4)
    list(tiny_engine.generate(result, SamplingParams(max_new_tokens=4)))
    with pytest.raises(InvalidRequest, match="already been decoded"):
        list(tiny_engine.generate(result, SamplingParams(max_new_tokens=4)))


def test_sampling_with_seed_is_repeatable_and_stops_at_budget(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    texts = []
    for _ in range(2):
        result = tiny_engine.prefill(chunks, QUESTION, CACHEBLEND, max_new_tokens=6)
        params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=7)
        text, decoded = read_out(tiny_engine.generate(result, params))
        texts.append(text)
        assert len(decoded.token_ids) <= 6
    assert texts[0] == texts[1]


def test_failed_selfcheck_refuses_reuse_and_uses_full(tiny_loaded, monkeypatch, tmp_path):
    """A rope whose shift does not compose (simulated: a wrong shift) disables reuse modes."""
    import engine.model.selfcheck as selfcheck

    def broken_shift(k, delta, inv_freq):
        return k.mul_(1.01)

    monkeypatch.setattr(selfcheck.ops, "rope_shift_", broken_shift)
    engine = Engine(EngineConfig(data_dir=tmp_path), tiny_loaded)
    monkeypatch.undo()
    assert not engine.reuse_available
    result = engine.prefill(chunk_inputs(engine), QUESTION, mode=Mode.named("cacheblend"))
    assert result.mode.name == "full"
    assert "self-check failed" in result.fallback_reason
    full = engine.prefill(chunk_inputs(engine), QUESTION, mode=Mode.named("full"))
    torch.testing.assert_close(result.logits, full.logits)


def test_a_tiny_temperature_picks_the_top_token():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    assert pick_token(logits, SamplingParams(temperature=5e-324), None) == 1
