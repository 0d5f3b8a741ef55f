"""The fidelity guard on the tiny model: exact is full, fast is the mode, balanced escalates by its
rule."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, InvalidRequest
from engine.config import Fidelity
from engine.engine import Engine
from engine.planners import Mode
from engine.serving.guard import first_token_margin
from tests.engine.helpers import QUESTION, chunk_inputs


@pytest.fixture(scope="module")
def chunks(tiny_engine):
    return chunk_inputs(tiny_engine)


def engine_with(tiny_engine, **overrides) -> Engine:
    """Another engine over the same tiny model, with guard settings overridden; its balanced
    requests blend (reuse profile off: no profile would make them exact-first)."""
    overrides.setdefault("reuse_profile", "off")
    return Engine(
        EngineConfig(data_dir=tiny_engine.config.data_dir, epic_tokens=4, **overrides),
        tiny_engine.loaded,
    )


@pytest.mark.parametrize("mode", ["cacheblend", "cachecraft", "naive", "epic"])
def test_exact_equals_full(tiny_engine, chunks, mode):
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    exact = tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named(mode), fidelity=Fidelity.named("exact")
    )
    assert torch.equal(exact.logits, full.logits)
    n = full.layout.total_len
    assert torch.equal(exact.cache.data[:, :, :, :n], full.cache.data[:, :, :, :n])
    assert exact.mode.name == mode and exact.recompute_share == 1.0
    assert {c.strategy for c in exact.chunks} == {"full"}
    assert exact.guard.fidelity is Fidelity.EXACT and not exact.guard.escalated


def test_fast_is_the_mode_alone_and_reports_its_estimate(tiny_engine, chunks):
    config_fast = engine_with(tiny_engine, fidelity="fast", guard_margin=1e9)
    plain = config_fast.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    fast = tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), fidelity=Fidelity.named("fast")
    )
    assert torch.equal(fast.logits, plain.logits)
    assert fast.recompute_share < 1.0 and not fast.guard.escalated and fast.guard.spent_s == 0.0
    assert (
        fast.guard.margin == pytest.approx(first_token_margin(fast.logits))
        and fast.guard.margin >= 0
    )


def test_balanced_escalates_below_the_margin_and_equals_full(tiny_engine, chunks):
    always = engine_with(tiny_engine, guard_margin=1e9)
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    result = always.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    assert result.guard.fidelity is Fidelity.BALANCED and result.guard.escalated
    assert result.guard.spent_s > 0.0 and result.ttft_s >= result.guard.spent_s
    assert_equals_full(result, full)
    assert result.mode.name == "cacheblend"
    assert {c.strategy for c in result.chunks} == {"full"}
    assert [c.compute_share for c in result.chunks] == [0.0] + [1.0] * (len(chunks) - 1)


def assert_equals_full(result, full) -> None:
    """An escalated prefill is full's to float tolerance: the re-run kept the exact rows of the
    blended run (system prefix, first chunk: its base variant is exact there) as prefix caching
    would and computed every later row through every layer."""
    n = full.layout.total_len
    assert torch.allclose(result.logits, full.logits, atol=1e-4)
    assert torch.allclose(result.cache.data[:, :, :, :n], full.cache.data[:, :, :, :n], atol=1e-4)
    exact_rows = full.layout.chunk_spans[0][1]
    assert int(result.layers_computed[:exact_rows].sum()) == 0
    assert bool((result.layers_computed[exact_rows:] == full.layers_computed[exact_rows:]).all())


def test_balanced_keeps_a_confident_prefill(tiny_engine, chunks):
    never = engine_with(tiny_engine, guard_margin=0.0, guard_recompute_ratio=None)
    fast = tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), fidelity=Fidelity.named("fast")
    )
    result = never.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    assert not result.guard.escalated and result.guard.threshold == 0.0
    assert torch.equal(result.logits, fast.logits)


def test_balanced_first_attempt_recomputes_its_own_ratio_and_fast_keeps_the_blends(
    tiny_engine, chunks
):
    """A request naming no ratio: balanced blends at guard_recompute_ratio, fast at
    recompute_ratio; a ratio the request names wins at either level."""
    engine = engine_with(
        tiny_engine, guard_margin=0.0, recompute_ratio=0.1, guard_recompute_ratio=0.6
    )
    balanced = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    fast = engine.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), fidelity=Fidelity.named("fast")
    )
    assert not balanced.guard.escalated
    assert torch.equal(
        fast.logits,
        engine.prefill(
            chunks,
            QUESTION,
            mode=Mode.named("cacheblend"),
            fidelity=Fidelity.named("fast"),
            ratio=0.1,
        ).logits,
    )
    assert torch.equal(
        balanced.logits,
        engine.prefill(
            chunks,
            QUESTION,
            mode=Mode.named("cacheblend"),
            fidelity=Fidelity.named("fast"),
            ratio=0.6,
        ).logits,
    )
    assert balanced.recompute_share > fast.recompute_share
    named = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.1)
    assert torch.equal(named.logits, fast.logits)


@pytest.mark.parametrize("mode", ["naive", "epic", "cachecraft"])
def test_every_reuse_mode_is_guarded(tiny_engine, chunks, mode):
    full = tiny_engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    result = engine_with(tiny_engine, guard_margin=1e9).prefill(
        chunks, QUESTION, mode=Mode.named(mode)
    )
    assert result.guard.escalated
    assert_equals_full(result, full)


def test_full_is_never_guarded(tiny_engine, chunks):
    result = engine_with(tiny_engine, guard_margin=1e9).prefill(
        chunks, QUESTION, mode=Mode.named("full")
    )
    assert not result.guard.escalated and result.guard.margin is None


def test_unknown_fidelity_is_refused():
    with pytest.raises(InvalidRequest, match="unknown fidelity 'perfect'; known: fast, balanced"):
        Fidelity.named("perfect")


def test_config_refuses_bad_guard_settings(tmp_path):
    with pytest.raises(ValueError, match="unknown fidelity 'perfect'"):
        EngineConfig(fidelity="perfect")
    assert EngineConfig(fidelity="fast").fidelity is Fidelity.FAST  # a name becomes its level
    with pytest.raises(ValueError, match="guard_margin"):
        EngineConfig(guard_margin=-1.0)
    with pytest.raises(ValueError, match="guard_recompute_ratio"):
        EngineConfig(guard_recompute_ratio=1.5)


def test_the_report_says_what_the_guard_estimated_against_the_floor():
    from engine.serving.guard import GuardReport

    assert (
        "inside full prefill's reorder floor; kept"
        in GuardReport(Fidelity.BALANCED, 2.5, 1.0).estimate
    )
    rerun = GuardReport(Fidelity.BALANCED, 0.4, 1.0, escalated=True).estimate
    assert "0.40 nats against threshold 1.00: may leave" in rerun and rerun.endswith(
        "re-ran in full"
    )
    assert (
        "repaired at answer token 3"
        in GuardReport(Fidelity.BALANCED, 2.5, 1.0, repaired_at=3).estimate
    )
    assert "not judged (fast)" in GuardReport(Fidelity.FAST, 0.1, 1.0).estimate
    assert GuardReport(Fidelity.BALANCED).estimate == "exact state: nothing to judge"
    assert GuardReport(Fidelity.EXACT).estimate == "exact: full prefill"
    assert "busy" in GuardReport(Fidelity.BALANCED, skipped_blend=True).estimate
