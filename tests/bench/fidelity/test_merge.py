"""Shards of `bench fidelity` merge into the report one run over all their cases would give."""

from __future__ import annotations

import json
import random

import pytest

from app.cli import main
from bench.fidelity.accuracy import Score
from bench.fidelity.fidelity import FLOOR, REFERENCE, ModeSample, summarize_rows, write_report
from bench.fidelity.merge import load_shard, merge_shards, paired_rows
from engine.errors import InvalidRequest

MODES = (REFERENCE, "cachecraft")
OPTIONS = {
    "dataset": "/tmp/cases.json",
    "chunks": 6,
    "modes": list(MODES),
    "orders": 2,
    "max_new_tokens": 16,
    "seed": 0,
    "warmup_orders": 0,
    "ratio": None,
    "fidelity": None,
}


def _sample(rng: random.Random, case: int, order: int, reference: bool) -> ModeSample:
    contains = float(rng.random() < 0.4)
    return ModeSample(
        ttft_s=rng.uniform(0.5, 5.0),
        ttft_ratio=1.0 if reference else rng.uniform(2, 4),
        compute_ratio=1.0,
        recompute_share=1.0 if reference else rng.random(),
        kl=0.0 if reference else rng.random(),
        top1=True,
        rouge_l=rng.random(),
        f1=rng.random(),
        answer="a",
        case=case,
        order=order,
        identical=reference,
        score=Score(contains, 0.0, rng.random()),
    )


def _samples(cases: range, seed: int) -> dict[str, list[ModeSample]]:
    rng = random.Random(seed)
    out: dict[str, list[ModeSample]] = {REFERENCE: [], FLOOR: [], "cachecraft": []}
    for case in cases:
        for order in range(2):
            out[REFERENCE].append(_sample(rng, case, order, True))
            out["cachecraft"].append(_sample(rng, case, order, False))
            if order:
                out[FLOOR].append(_sample(rng, case, order, False))
    return out


def _write_shard(tmp_path, cases: range, seed: int, **changes):
    samples = _samples(cases, seed)
    path = tmp_path / f"shard-{cases.start}.json"
    options = {**OPTIONS, "start": cases.start, "n": len(cases), **changes}
    write_report(options, summarize_rows(samples, MODES), path)
    return path, samples


def test_merged_figures_are_those_of_one_run_over_every_case(tmp_path):
    first, a = _write_shard(tmp_path, range(0, 7), seed=1)
    second, b = _write_shard(tmp_path, range(7, 12), seed=2)
    options, merged = merge_shards([load_shard(second), load_shard(first)])
    whole = summarize_rows({k: a[k] + b[k] for k in a}, MODES)
    assert [s.mode for s in merged] == [REFERENCE, FLOOR, "cachecraft"]
    for got, want in zip(merged, whole):
        assert got.records == want.records
        assert got.mean_kl == pytest.approx(want.mean_kl)
        assert got.median_ttft_ratio == pytest.approx(want.median_ttft_ratio)
        assert got.accuracy.mean == pytest.approx(want.accuracy.mean)
        assert got.accuracy_vs_full.mean == pytest.approx(want.accuracy_vs_full.mean)
    assert (options["start"], options["n"]) == (0, 12)
    assert [(s["start"], s["n"]) for s in options["shards"]] == [(7, 5), (0, 7)]
    assert merged[0].records == 12


def test_overlapping_or_unlike_shards_are_refused(tmp_path):
    first, _ = _write_shard(tmp_path, range(0, 6), seed=1)
    overlapping, _ = _write_shard(tmp_path, range(5, 9), seed=2)
    with pytest.raises(InvalidRequest, match="overlap"):
        merge_shards([load_shard(first), load_shard(overlapping)])
    unlike, _ = _write_shard(tmp_path, range(20, 24), seed=3, max_new_tokens=32)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        merge_shards([load_shard(first), load_shard(unlike)])
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"modes": []}))
    with pytest.raises(InvalidRequest, match="not a `bench fidelity --json` report"):
        load_shard(junk)


def test_the_command_prints_the_merged_table_and_writes_it(tmp_path, capsys):
    first, _ = _write_shard(tmp_path, range(0, 4), seed=1)
    second, _ = _write_shard(tmp_path, range(4, 8), seed=2)
    out = tmp_path / "merged.json"
    pair = ["--pair", f"cachecraft,{REFERENCE}"]
    assert (
        main(["bench", "fidelity-merge", str(first), str(second), "--json", str(out), *pair]) == 0
    )
    printed = capsys.readouterr().out
    assert f"cachecraft - {REFERENCE}: " in printed
    assert "records 0..3, 4..7 of cases.json (8 in 2 shards)" in printed
    assert "floor" in printed and "cachecraft" in printed
    assert json.loads(out.read_text())["options"]["n"] == 8


def test_two_rows_are_paired_case_by_case():
    samples = _samples(range(40), seed=3)
    summaries = summarize_rows(samples, MODES)
    against_full = {s.mode: s for s in summaries}["cachecraft"].accuracy_vs_full
    assert paired_rows(summaries, "cachecraft", REFERENCE) == against_full
    swapped = paired_rows(summaries, REFERENCE, "cachecraft")
    assert swapped.mean == pytest.approx(-against_full.mean)
    assert paired_rows(summaries, "cachecraft", "cachecraft").mean == 0.0
    with pytest.raises(InvalidRequest, match="no row 'nope'"):
        paired_rows(summaries, "nope", REFERENCE)
