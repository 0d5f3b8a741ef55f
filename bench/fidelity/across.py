"""One mode of one fidelity run against a mode of another, paired by case and order.

`python -m bench.fidelity.across A.json:MODE B.json:MODE` reads two `kvmosaic bench fidelity`
(or `fidelity-merge`) JSON files of the same cases and orders (two dtypes, two commits) and
prints how often the answers are the same, their mean ROUGE-L (B's answer the reference), and
A's accuracy minus B's with its paired 95% interval over cases: what `auto`'s dtype rules ask of
bfloat16 `full` against float32 `full` (docs/benchmarks/bfloat16.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fidelity.accuracy import Interval, paired_difference, per_case_means
from bench.fidelity.metrics import rouge_l


@dataclass(frozen=True)
class Across:
    """Mode A against mode B on the same samples."""

    samples: int
    same_answer: float
    rouge_l: float
    accuracy_a: float
    accuracy_b: float
    difference: Interval

    def __str__(self) -> str:
        return (
            f"{self.samples} samples: same answer {self.same_answer:.2f}, ROUGE-L "
            f"{self.rouge_l:.3f}, accuracy {self.accuracy_a:.3f} against {self.accuracy_b:.3f}, "
            f"difference {self.difference.mean:+.3f} "
            f"[{self.difference.low:+.3f}, {self.difference.high:+.3f}]"
        )


def samples_of(path: Path, mode: str) -> dict[tuple[int, int], dict[str, Any]]:
    """{(case, order): sample} of `mode` in the run's JSON."""
    run = json.loads(Path(path).read_text())
    for row in run["modes"]:
        if row["mode"] == mode:
            return {(s["case"], s["order"]): s for s in row["samples"]}
    names = ", ".join(row["mode"] for row in run["modes"])
    raise SystemExit(f"{path} has no mode {mode!r} (it has {names})")


def compare(
    a: dict[tuple[int, int], dict[str, Any]], b: dict[tuple[int, int], dict[str, Any]]
) -> Across:
    """A against B on the samples both ran; refuses runs of other cases or orders."""
    if set(a) != set(b):
        raise SystemExit(
            f"the runs differ in cases or orders ({len(set(a) ^ set(b))} samples in one only)"
        )
    keys = sorted(a)
    cases = [case for case, _ in keys]
    contains_a = per_case_means([a[k]["score"]["contains"] for k in keys], cases)
    contains_b = per_case_means([b[k]["score"]["contains"] for k in keys], cases)
    return Across(
        samples=len(keys),
        same_answer=statistics.fmean(a[k]["answer"] == b[k]["answer"] for k in keys),
        rouge_l=statistics.fmean(rouge_l(a[k]["answer"], b[k]["answer"]) for k in keys),
        accuracy_a=statistics.fmean(contains_a),
        accuracy_b=statistics.fmean(contains_b),
        difference=paired_difference(contains_a, contains_b),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="RUN.json:MODE")
    parser.add_argument("b", help="RUN.json:MODE (the reference)")
    args = parser.parse_args(argv)
    runs = []
    for spec in (args.a, args.b):
        path, _, mode = spec.rpartition(":")
        if not path:
            parser.error(f"{spec!r}: name a mode, as RUN.json:MODE")
        runs.append(samples_of(Path(path), mode))
    print(compare(*runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
