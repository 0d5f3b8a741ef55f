"""Reuse profiles: balanced runs only the blends a model's profile passed, else exact-first."""

from __future__ import annotations

import json

import pytest
import torch

from engine import EngineConfig
from engine.config import Fidelity
from engine.engine import Engine
from engine.model.known import KNOWN_MODELS
from engine.planners import Mode
from engine.serving.profile import (
    ProfileError,
    ReuseProfile,
    calibrated_path,
    known_path,
    load_profile,
    read_profile,
    write_profile,
)
from tests.engine.helpers import QUESTION, chunk_inputs

BLENDS = ["cacheblend", "cachecraft", "naive", "epic"]


@pytest.fixture(scope="module")
def chunks(tiny_engine):
    return chunk_inputs(tiny_engine)


def engine_with(tiny_engine, tmp_path, profile: ReuseProfile | None = None, **overrides):
    """An engine over the tiny model (no profile of its own) in its own data dir; batching off
    so that no busy skip interferes."""
    config = EngineConfig(data_dir=tmp_path, epic_tokens=4, batching=False, **overrides)
    return Engine(config, tiny_engine.model_loaded, profile=profile)


@pytest.mark.parametrize("mode", BLENDS)
def test_no_profile_makes_balanced_exact_first_and_equal_to_full(
    tiny_engine, chunks, tmp_path, mode
):
    engine = engine_with(tiny_engine, tmp_path)
    assert engine.profile.source == "none" and engine.profile.balanced_modes == ()
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    first = engine.prefill(chunks, QUESTION, mode=Mode.named(mode), fidelity=Fidelity.BALANCED)
    assert first.guard.exact_first and first.guard.outcome == "exact-first"
    assert first.watch is None and first.guard.margin is None  # nothing blended, nothing watched
    assert torch.allclose(first.logits, full.logits, atol=1e-4)
    # the first chunk's base KV is exact where it sits (right after the system prefix): reused;
    # every later one was computed
    assert [r.recomputed for r in first.chunks] == [0] + [r.tokens for r in first.chunks[1:]]


def test_fast_is_never_restricted(tiny_engine, chunks, tmp_path):
    engine = engine_with(tiny_engine, tmp_path)
    fast = engine.prefill(chunks, QUESTION, mode=Mode.named("naive"), fidelity=Fidelity.FAST)
    assert not fast.guard.exact_first and fast.guard.margin is not None


def test_a_profile_that_passed_a_mode_lets_balanced_blend_it_only(tiny_engine, chunks, tmp_path):
    profile = ReuseProfile("tiny", balanced_modes=("cacheblend",), source="test")
    engine = engine_with(tiny_engine, tmp_path, profile, guard_margin=0.0)
    blended = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    assert not blended.guard.exact_first and blended.guard.margin is not None
    naive = engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    assert naive.guard.exact_first


def test_reuse_profile_off_blends_every_mode(tiny_engine, chunks, tmp_path):
    engine = engine_with(tiny_engine, tmp_path, reuse_profile="off", guard_margin=0.0)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    assert not result.guard.exact_first and result.guard.margin is not None


def test_the_profile_s_thresholds_replace_the_settings(tiny_engine, chunks, tmp_path):
    # a margin no first token reaches: every allowed blend is re-run in full
    profile = ReuseProfile("tiny", ("cacheblend",), guard={"guard_margin": 1e9}, source="test")
    engine = engine_with(tiny_engine, tmp_path, profile, guard_margin=0.0)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    assert result.guard.escalated and result.guard.threshold == 1e9


def test_a_calibrated_profile_in_the_data_dir_is_loaded(tiny_engine, chunks, tmp_path):
    fingerprint = tiny_engine.loaded.fingerprint
    profile = ReuseProfile("tiny", ("cachecraft",), guard={"guard_answer_margin": 0.7})
    write_profile(calibrated_path(tmp_path, fingerprint), profile, {"rule": "test"})
    engine = engine_with(tiny_engine, tmp_path)
    assert engine.profile.balanced_modes == ("cachecraft",)
    assert engine.profile.source == str(calibrated_path(tmp_path, fingerprint))
    assert "balanced blends cachecraft" in engine.profile.summary


def test_a_calibrated_profile_wins_over_the_known_model_s(tmp_path):
    path = calibrated_path(tmp_path, "abc")
    write_profile(path, ReuseProfile("smollm2-135m", ("cacheblend",)), {})
    assert load_profile(tmp_path, "abc", "smollm2-135m").source == str(path)
    assert load_profile(tmp_path, "other", "smollm2-135m").source == str(known_path("smollm2-135m"))


@pytest.mark.parametrize(
    "body, fault",
    [
        ("{not json", "cannot be read"),
        (json.dumps({"version": 99, "model": "m"}), "not a version 1"),
        (json.dumps({"version": 1, "model": "m", "balanced_modes": ["turbo"]}), "unknown modes"),
        (
            json.dumps({"version": 1, "model": "m", "guard": {"guard_margin": -1}}),
            "bad guard value",
        ),
    ],
)
def test_a_bad_profile_file_names_itself_and_the_fix(tmp_path, body, fault):
    path = tmp_path / "p.json"
    path.write_text(body)
    with pytest.raises(ProfileError, match=fault) as refused:
        read_profile(path)
    assert str(path) in str(refused.value) and "calibrate profile" in str(refused.value)


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_every_known_model_has_a_committed_profile_with_its_measurement(name):
    profile = read_profile(known_path(name))
    assert profile.model == name and profile.evidence.startswith("docs/benchmarks/profiles.md")
    record = json.loads(known_path(name).read_text())["measurement"]
    assert record["cases"]["seeds"] == "tuning"  # never decided on report seeds
    decided = {trial["mode"] for trial in record["trials"] if trial["passed"]}
    assert set(profile.balanced_modes) == decided
