"""bench fidelity's answer-level figures and guard levels, on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from bench.fidelity.fidelity import (
    FidelityOptions,
    fidelity_of,
    format_table,
    mode_of,
    run_fidelity,
)
from engine.config import Fidelity
from tests.engine.helpers import PASSAGES


@pytest.fixture()
def dataset(tmp_path):
    ctxs = [{"title": title, "text": text} for title, text in PASSAGES]
    records = [
        {
            "question": "Who wrote the first published algorithm?",
            "answers": ["Ada Lovelace"],
            "ctxs": ctxs,
        }
    ]
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    return path


def test_row_labels_name_mode_and_level(dataset):
    options = FidelityOptions(dataset=dataset, fidelity="balanced")
    assert (
        mode_of("cachecraft@fast+warm3").name == "cachecraft"
        and fidelity_of("cachecraft@fast+warm3", options) is Fidelity.FAST
    )
    assert (
        mode_of("cacheblend").name == "cacheblend"
        and fidelity_of("cacheblend", options) is Fidelity.BALANCED
    )


def test_answer_figures_and_guard_share(tiny_engine, dataset):
    options = FidelityOptions(
        dataset=dataset, n=1, chunks=4, modes=("naive@fast", "naive@exact"), max_new_tokens=6
    )
    summaries = {s.mode: s for s in run_fidelity(tiny_engine, options, progress=False)}
    full, fast, exact = summaries["full"], summaries["naive@fast"], summaries["naive@exact"]
    if math.isnan(full.answer_top1):
        pytest.skip("the tiny model's greedy answer was empty")
    assert full.answer_top1 == 1.0 and full.answer_kl == pytest.approx(0.0, abs=1e-6)
    assert exact.answer_top1 == 1.0 and exact.answer_kl == pytest.approx(0.0, abs=1e-6)
    assert exact.recompute_share == 1.0 and fast.recompute_share == 0.0
    assert fast.answer_kl > 1e-6 and 0.0 <= fast.answer_top1 <= 1.0
    assert fast.escalated == 0.0 and exact.escalated == 0.0
    speed, answers = format_table(list(summaries.values())).split("\n\n")
    assert "guard" in speed.splitlines()[0]
    assert "ans top1" in answers.splitlines()[0] and "ans KL" in answers.splitlines()[0]


def test_row_settings_plan_that_row_only(tiny_engine, dataset):
    from bench.fidelity.fidelity import row_config, settings_of
    from engine.errors import InvalidRequest

    label = "cacheblend@balanced[guard_margin=0.25;focus_layer=1;guard_recompute_ratio=none]+warm2"
    assert (
        mode_of(label).name == "cacheblend"
        and fidelity_of(label, FidelityOptions(dataset=dataset)) is Fidelity.BALANCED
    )
    assert settings_of(label) == {
        "guard_margin": "0.25",
        "focus_layer": "1",
        "guard_recompute_ratio": "none",
    }
    config = row_config(label, tiny_engine.config)
    assert (config.guard_margin, config.focus_layer, config.guard_recompute_ratio) == (
        0.25,
        1,
        None,
    )
    assert row_config("cacheblend", tiny_engine.config) == tiny_engine.config
    for bad, message in (
        ("cacheblend[dtype=bfloat16]", "not an engine setting"),
        ("cacheblend[no_such=1]", "not an engine setting"),
        ("cacheblend[guard_margin=-1]", "guard_margin"),
        ("cacheblend[guard_margin]", "key=value"),
        ("cacheblend[guard_margin=1", "brackets"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            row_config(bad, tiny_engine.config)
    # the row's settings reach its prefills: a margin no first token can reach re-runs every blend
    # (reuse profile off: balanced blends on a model without a profile)
    options = FidelityOptions(
        dataset=dataset,
        n=1,
        chunks=4,
        max_new_tokens=2,
        orders=1,
        modes=(
            "cacheblend@balanced[guard_margin=1000;reuse_profile=off]",
            "cacheblend@balanced[guard_margin=0;reuse_profile=off]",
        ),
    )
    summaries = {s.mode: s for s in run_fidelity(tiny_engine, options, progress=False)}
    assert summaries["cacheblend@balanced[guard_margin=1000;reuse_profile=off]"].escalated == 1.0
    assert summaries["cacheblend@balanced[guard_margin=0;reuse_profile=off]"].escalated == 0.0


def test_a_row_may_read_its_chunk_kv_through_a_codec(tiny_engine, dataset):
    from engine.errors import InvalidRequest

    calls = []

    def halve(kv):
        calls.append(kv.num_tokens)
        return dataclasses.replace(kv, kv=kv.kv * 0.5)

    options = FidelityOptions(
        dataset=dataset,
        n=1,
        chunks=4,
        max_new_tokens=2,
        orders=1,
        modes=("naive@fast", "naive@fast[codec=half]"),
    )
    summaries = {
        s.mode: s
        for s in run_fidelity(tiny_engine, options, progress=False, codecs={"half": halve})
    }
    assert len(calls) == 4  # every chunk of the one row, once
    plain, halved = summaries["naive@fast"], summaries["naive@fast[codec=half]"]
    assert halved.mean_kl > plain.mean_kl  # the row really read the transformed KV
    with pytest.raises(InvalidRequest, match="no codec 'half'"):
        run_fidelity(tiny_engine, options, progress=False)
