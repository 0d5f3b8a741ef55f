"""The fidelity benchmark and the calibration on the tiny model: figures that must hold."""

from __future__ import annotations

import json

import pytest
import torch

from bench.fidelity.calibrate import CalibrateOptions, CurvePoint, fit_alpha, run_calibration
from bench.fidelity.fidelity import (
    FidelityOptions,
    format_table,
    load_dataset,
    run_fidelity,
    write_json,
)
from bench.fidelity.flops import FlopCounter
from engine.errors import InvalidRequest
from tests.engine.helpers import PASSAGES


@pytest.fixture()
def dataset(tmp_path):
    ctxs = [{"title": title, "text": text} for title, text in PASSAGES]
    records = [
        {
            "question": "Who wrote the first published algorithm?",
            "answers": ["Ada Lovelace"],
            "ctxs": ctxs,
        },
        {
            "question": "How many countries does the Danube cross?",
            "answers": ["ten"],
            "ctxs": ctxs[::-1],
        },
    ]
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    return path


def test_flop_counter_counts_linear_and_positional_attention_work(tiny_engine):
    counter = FlopCounter.for_engine(tiny_engine)
    layer = tiny_engine.loaded.model.model.layers[0]
    linear = 2 * sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    spec = tiny_engine.loaded.spec
    per_key = 4 * spec.num_heads * spec.head_dim
    # row 0 ran 2 layers over 1 key, row 1 none, row 2 one layer over 3 keys
    expected = 2 * (linear + per_key * 1) + (linear + per_key * 3)
    assert counter.prefill(torch.tensor([2, 0, 1])) == pytest.approx(expected)


def test_fidelity_figures_against_full(tiny_engine, dataset, tmp_path):
    options = FidelityOptions(
        dataset=dataset,
        n=2,
        chunks=4,
        modes=("naive", "cacheblend", "cachecraft"),
        ratio=0.25,
        max_new_tokens=4,
        warmup_orders=1,
        orders=1,
    )
    summaries = {s.mode: s for s in run_fidelity(tiny_engine, options, progress=False)}
    full, naive, blend = summaries["full"], summaries["naive"], summaries["cacheblend"]
    # one chunk order: no floor row
    assert list(summaries) == ["full", "naive", "cacheblend", "cachecraft", "cachecraft+warm1"]
    # the cold row pays no warm-up; the warm row's untimed request cost about one prefill
    assert summaries["cachecraft"].warmup_cost == 0.0
    assert 0.1 < summaries["cachecraft+warm1"].warmup_cost < 1.0
    assert (
        full.median_ttft_ratio,
        full.median_compute_ratio,
        full.mean_kl,
        full.top1_agreement,
        full.rouge_l,
        full.recompute_share,
        full.identical,
    ) == (1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0)
    assert naive.recompute_share == 0.0 and naive.mean_kl > 0.0
    assert 0.2 < blend.recompute_share < 0.35
    # recomputing more rows leaves less of full's arithmetic out
    assert naive.median_compute_ratio > blend.median_compute_ratio > 1.0
    assert all(s.records == 2 for s in summaries.values())
    speed, answers = format_table(list(summaries.values())).split("\n\n")
    assert (
        "floor" in speed.splitlines()[0]
        and "warm-up" in speed.splitlines()[0]
        and len(speed.splitlines()) == 7
    )
    assert "accuracy [95%]" in answers.splitlines()[0] and len(answers.splitlines()) == 7
    write_json(list(summaries.values()), options, tmp_path / "out.json")
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["modes"][2]["median_compute_ratio"] == blend.median_compute_ratio


def test_every_row_runs_in_every_order_and_the_floor_is_full_against_its_first_order(
    tiny_engine, dataset
):
    options = FidelityOptions(
        dataset=dataset, n=2, chunks=4, modes=("naive",), max_new_tokens=4, orders=3
    )
    summaries = {s.mode: s for s in run_fidelity(tiny_engine, options, progress=False)}
    assert list(summaries) == ["full", "floor", "naive"]
    full, floor, naive = summaries["full"], summaries["floor"], summaries["naive"]
    assert [(s.case, s.order) for s in full.samples] == [(c, o) for c in (0, 1) for o in range(3)]
    assert [(s.case, s.order) for s in naive.samples] == [(s.case, s.order) for s in full.samples]
    # the floor: full in orders 1 and 2 of each record, against full in order 0
    assert [(s.case, s.order) for s in floor.samples] == [(c, o) for c in (0, 1) for o in (1, 2)]
    assert floor.mean_kl > 0.0  # another order is another prompt, even for full prefill
    assert floor.work_share == 1.0 and floor.median_ttft_ratio == 1.0
    # accuracy is paired with full on the same cases and orders: full against itself is exactly 0
    assert (full.accuracy_vs_full.mean, full.accuracy_vs_full.low, full.accuracy_vs_full.high) == (
        0.0,
        0.0,
        0.0,
    )
    assert full.accuracy.low <= full.accuracy.mean <= full.accuracy.high
    answers = format_table(list(summaries.values())).split("\n\n")[1]
    assert "x" in answers.splitlines()[-1].split()[7]  # naive's KL as a multiple of the floor's


def test_bad_datasets_are_clear_errors(tiny_engine, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"question": "not a list"}')
    with pytest.raises(InvalidRequest, match="is not a list"):
        load_dataset(broken)
    with pytest.raises(InvalidRequest, match="cannot read"):
        load_dataset(tmp_path / "missing.json")
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(InvalidRequest, match="slice is empty"):
        run_fidelity(tiny_engine, FidelityOptions(dataset=empty), progress=False)


def test_fit_alpha_takes_the_smallest_alpha_that_meets_the_target():
    points = [
        CurvePoint(0.05, 0.09, 0.9, 0.02, 12.0),
        CurvePoint(0.1, 0.04, 1.0, 0.04, 10.0),
        CurvePoint(0.3, 0.03, 1.0, 0.1, 7.0),
    ]
    assert fit_alpha(points, 0.05) == (points[1], True)
    assert fit_alpha(points, 0.01) == (points[2], False)  # none meets it: the lowest KL


def test_calibration_curve_recomputes_more_at_larger_alpha(tiny_engine, dataset):
    options = CalibrateOptions(
        dataset=dataset, n=2, chunks=4, alphas=(0.0, 1.0), warmup_orders=2, swap=1
    )
    configured = tiny_engine.config
    (low, high), blend = run_calibration(tiny_engine, options, progress=False)
    assert (low.alpha, high.alpha) == (0.0, 1.0)
    # α 0 takes every built variant as is; α 1 fixes the ones it keeps, hands others to the blend
    assert low.recompute_share < high.recompute_share
    assert low.variant_share > 0.0 and high.variant_share <= low.variant_share
    assert 0.0 < blend.recompute_share < 1.0 and blend.mean_kl > 0.0
    assert tiny_engine.config is configured  # the engine's own α is back


def test_calibration_passes_each_alpha_per_call_and_never_swaps_the_engine_config(
    tiny_engine, dataset, monkeypatch
):
    configured, prefill, alphas = tiny_engine.config, tiny_engine.prefill, []

    def watched(*args, config=None, **kwargs):
        assert tiny_engine.config is configured  # what another thread would read meanwhile
        alphas.append(None if config is None else config.craft_alpha)
        return prefill(*args, config=config, **kwargs)

    monkeypatch.setattr(tiny_engine, "prefill", watched)
    options = CalibrateOptions(
        dataset=dataset, n=1, chunks=3, alphas=(0.25, 2.0), warmup_orders=1, swap=1
    )
    run_calibration(tiny_engine, options, progress=False)
    assert [a for a in alphas if a is not None] == [0.25, 2.0]


def test_calibration_refuses_a_swap_that_leaves_no_shared_chunk(tiny_engine, dataset):
    with pytest.raises(InvalidRequest, match="swap"):
        run_calibration(
            tiny_engine, CalibrateOptions(dataset=dataset, n=1, chunks=2, swap=2), progress=False
        )


def test_a_decode_weights_row_decodes_fulls_own_prefill_with_those_weights(
    tiny_engine, dataset, monkeypatch
):
    import engine.model.decode as decode_module

    stack = tiny_engine.stack
    if stack.native is None:
        pytest.skip(f"the native decode step cannot run here: {stack.native_unfit}")
    own = stack.native
    seen, prefills = [], []
    real_step, real_prefill = decode_module.native_step, tiny_engine.prefill

    def recording_step(s):
        seen.append(real_step(s).weights)
        return real_step(s)

    def counting_prefill(*args, **kwargs):
        prefills.append(1)
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(decode_module, "native_step", recording_step)
    monkeypatch.setattr(tiny_engine, "prefill", counting_prefill)
    row = "full[decode_weights=int8]"
    options = FidelityOptions(
        dataset=dataset, n=2, chunks=4, modes=(row,), max_new_tokens=4, orders=1
    )
    summaries = {s.mode: s for s in run_fidelity(tiny_engine, options, progress=False)}
    assert len(prefills) == 2 + 2  # the warm-up: one per row; then full alone per record
    assert "int8" in seen and own.weights in seen
    assert stack.native is own  # the engine's own step is back
    reused = summaries[row]
    assert (reused.median_ttft_ratio, reused.mean_kl, reused.top1_agreement) == (1.0, 0.0, 1.0)


@pytest.mark.parametrize("row", ["full[decode_weights=auto]", "full[decode_weights=int3]"])
def test_a_decode_weights_row_names_a_format(tiny_engine, dataset, row):
    options = FidelityOptions(dataset=dataset, n=1, chunks=4, modes=(row,), max_new_tokens=2)
    with pytest.raises(InvalidRequest, match="decode_weights"):
        run_fidelity(tiny_engine, options, progress=False)
