"""The decode bench times the engine's own step on the tiny model and splits it into pieces."""

from __future__ import annotations

import pytest
import torch

from bench.compute.decode import (
    PIECES,
    corpus_cache,
    decode_weight_bytes,
    figures_json,
    format_report,
    run_decode_bench,
)
from engine.model.decode import decode_step


def test_the_corpus_cache_is_the_prefix_then_the_articles(tiny_engine):
    cache, last = corpus_cache(tiny_engine, 60)
    prefix = tiny_engine.prefix_kv.kv
    assert cache.length == cache.capacity == prefix.shape[3] + 59
    assert torch.equal(cache.data[:, :, :, : prefix.shape[3]], prefix)
    assert isinstance(last, int)


def test_weight_bytes_count_every_tensor_of_a_step_once(tiny_engine):
    model = tiny_engine.loaded.model
    unique = {id(p): p for p in model.parameters()}  # tied lm_head: the embedding, once
    assert decode_weight_bytes(tiny_engine.stack) == sum(
        p.numel() * p.element_size() for p in unique.values()
    )


def test_the_bench_times_each_stream_count_and_its_split_adds_up(tiny_engine):
    (figures,) = run_decode_bench(tiny_engine, streams=(1, 3), context=40, steps=3, rounds=2)
    assert [s.streams for s in figures.streams] == [1, 3]
    for s in figures.streams:
        assert len(s.step_s) == 3 * 2 and min(s.step_s) > 0
        assert set(s.split_s) == {*PIECES, "python+dispatch", "total"}
        assert sum(s.split_s[p] for p in (*PIECES, "python+dispatch")) == pytest.approx(
            s.split_s["total"]
        )
        assert s.split_s["linear"] > 0 and s.split_s["attention"] > 0
    assert figures.floor_s() > 0 and figures.floor_s(3) > figures.floor_s()
    report = format_report(figures)
    assert "| 3 |" in report and "profile split" in report
    assert figures_json(figures)["streams"][1]["streams"] == 3


def test_the_instrumented_pass_leaves_the_step_as_it_was(tiny_engine):
    """The wrappers are gone afterwards: the same step gives the same logits."""
    cache, last = corpus_cache(tiny_engine, 30)
    before = decode_step(tiny_engine.stack, _roomy(cache), last)
    run_decode_bench(tiny_engine, streams=(1,), context=30, steps=1, rounds=1)
    assert torch.equal(decode_step(tiny_engine.stack, _roomy(cache), last), before)
    assert not any("forward" in vars(m) for m in tiny_engine.loaded.model.modules())


def _roomy(cache):
    return cache.copy(cache.length + 1)


def test_variants_compare_the_twin_and_each_weights_mode_in_one_run(tiny_engine):
    from bench.compute.decode import format_summary, variant_stacks

    stacks = variant_stacks(tiny_engine, ["twin", "model"])
    assert stacks["twin"].native_unfit is not None
    runs = run_decode_bench(
        tiny_engine, streams=(1, 4), context=30, steps=1, rounds=1, profile=False, stacks=stacks
    )
    assert [r.label for r in runs] == ["twin", "model"]
    assert stacks["twin"].native is None
    summary = format_summary(runs)
    assert "| twin |" in summary and "| model |" in summary


def test_variant_stacks_keep_the_rounded_weights_measured_for_the_model(tiny_engine, monkeypatch):
    from bench.compute.decode import variant_stacks

    monkeypatch.setattr(tiny_engine.stack, "rounded_decode_weights", "int8")
    stacks = variant_stacks(tiny_engine, ["auto", "model"])
    assert [s.rounded_decode_weights for s in stacks.values()] == ["int8", "int8"]
