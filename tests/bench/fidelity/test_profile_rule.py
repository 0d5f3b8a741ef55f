"""The rule that decides a reuse profile, on made-up fidelity reports, and its command."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from bench.fidelity.profile_rule import MIN_CASES, decide, judge_rows
from engine.serving.profile import read_profile

CASES = {"seeds": "tuning", "seed": 7, "n": MIN_CASES}


def row(mode, records=MIN_CASES, diff=(0.0, -0.03, 0.03), kl=0.05, rouge=0.9):
    mean, low, high = diff
    return {
        "mode": mode,
        "records": records,
        "mean_kl": kl,
        "rouge_l": rouge,
        "accuracy_vs_full": {"mean": mean, "low": low, "high": high},
    }


def report(*rows, fidelity="balanced"):
    full = row("full", kl=0.0, rouge=1.0)
    floor = row("floor", kl=0.1, rouge=0.8)  # floor shortfall 0.2
    return {
        "options": {"fidelity": fidelity, "n": MIN_CASES, "orders": 2},
        "modes": [full, floor, *rows],
    }


def test_a_row_inside_the_interval_and_the_floor_passes():
    (trial,) = judge_rows(report(row("cachecraft[reuse_profile=off]")))
    assert trial.passed and trial.mode == "cachecraft"


@pytest.mark.parametrize(
    "bad, why",
    [
        (dict(diff=(-0.09, -0.14, -0.05)), "accuracy"),
        (dict(kl=0.15), "KL 1.50x"),
        (dict(rouge=0.7), "ROUGE-L shortfall 1.50x"),
        (dict(records=MIN_CASES - 1), "only 99 cases"),
    ],
)
def test_each_fault_fails_the_row_and_says_why(bad, why):
    (trial,) = judge_rows(report(row("cacheblend[reuse_profile=off]", **bad)))
    assert not trial.passed and why in trial.why


def test_a_small_run_can_still_fail_a_row_on_its_interval():
    (trial,) = judge_rows(report(row("cacheblend", records=10, diff=(-0.3, -0.5, -0.1))))
    assert not trial.passed and "accuracy" in trial.why and "only" not in trial.why


def test_fast_rows_are_not_judged_and_a_run_without_a_floor_is_refused():
    assert judge_rows(report(row("naive@fast"))) == []
    with pytest.raises(ValueError, match="floor"):
        judge_rows({"options": {}, "modes": [row("full")]})


def test_decide_keeps_the_passing_modes_and_their_thresholds():
    payload = report(
        row("cachecraft[reuse_profile=off;guard_margin=1.5]"),
        row("cacheblend[reuse_profile=off]", kl=0.5),
    )
    profile, record = decide(payload, "m", "docs/benchmarks/profiles.md", CASES)
    assert profile.balanced_modes == ("cachecraft",)
    assert dict(profile.guard) == {"guard_margin": 1.5}
    assert [t["passed"] for t in record["trials"]] == [True, False]
    assert record["cases"]["seeds"] == "tuning"


def test_the_command_writes_the_profile_from_a_finished_run(tmp_path, capsys):
    source = tmp_path / "run.json"
    source.write_text(json.dumps(report(row("cachecraft[reuse_profile=off]", kl=0.5))))
    out = tmp_path / "profile.json"
    argv = ["calibrate", "profile", "--from", str(source), "--seed", "7", "--out", str(out)]
    assert main(argv + ["--model", "qwen2.5-coder-0.5b"]) == 0
    profile = read_profile(out)
    assert profile.model == "qwen2.5-coder-0.5b" and profile.balanced_modes == ()
    assert "fails (KL 5.00x the floor" in capsys.readouterr().out


def test_the_command_refuses_report_seeds(tmp_path, capsys):
    argv = ["calibrate", "profile", "--from", str(tmp_path / "x.json"), "--seed", "1000"]
    assert main(argv) != 0
    assert "not a tuning seed" in capsys.readouterr().err


def test_a_floor_of_zero_admits_only_zero_and_is_written_as_null():
    payload = report(row("cachecraft[reuse_profile=off]", rouge=0.9))
    payload["modes"][1]["rouge_l"] = 1.0  # full answered alike in both orders
    (trial,) = judge_rows(payload)
    assert not trial.passed and "ROUGE-L shortfall above a zero the floor" in trial.why
    assert trial.miss_over_floor is None
