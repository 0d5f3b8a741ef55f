"""Two fidelity runs' JSON compared mode against mode, paired by case and order."""

from __future__ import annotations

import json

import pytest

from bench.fidelity.across import main


def run_file(tmp_path, name, answers, contains):
    samples = [
        {"case": case, "order": order, "answer": answer, "score": {"contains": hit}}
        for (case, order), answer, hit in zip(
            [(0, 0), (0, 1), (1, 0), (1, 1)], answers, contains, strict=True
        )
    ]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"modes": [{"mode": "full", "samples": samples}]}))
    return path


def test_same_answers_rouge_and_the_paired_accuracy_difference(tmp_path, capsys):
    a = run_file(tmp_path, "a", ["Paris", "in Paris", "Rome", "Rome"], [1.0, 1.0, 1.0, 0.0])
    b = run_file(tmp_path, "b", ["Paris", "Paris", "Rome", "Oslo"], [1.0, 1.0, 0.0, 0.0])
    assert main([f"{a}:full", f"{b}:full"]) == 0
    out = capsys.readouterr().out
    # same answer in 2 of 4; ROUGE-L (1 + 2/3 + 1 + 0) / 4; accuracy 0.75 against 0.5
    assert "4 samples: same answer 0.50, ROUGE-L 0.667" in out
    assert "accuracy 0.750 against 0.500, difference +0.250" in out


def test_runs_of_other_cases_or_a_missing_mode_are_refused(tmp_path):
    a = run_file(tmp_path, "a", ["x"] * 4, [1.0] * 4)
    other = json.loads(a.read_text())
    other["modes"][0]["samples"][0]["case"] = 7
    b = tmp_path / "b.json"
    b.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="differ in cases or orders"):
        main([f"{a}:full", f"{b}:full"])
    with pytest.raises(SystemExit, match="no mode 'cachecraft'"):
        main([f"{a}:cachecraft", f"{a}:full"])
