"""Task accuracy against gold answers, with intervals that say whether two modes differ.

Scores: normalised gold containment (the gold answer, SQuAD-normalised, appears in the
normalised answer: a small model wraps its answers in sentences), exact match and token F1,
each the best over a case's gold answers. Intervals: percentile bootstrap over cases (a case's
value is its mean over the chunk orders it ran in), and the paired difference between two
modes on the same cases and orders, so that the spread between cases cancels out.
Why: task accuracy is what the papers report and what users need; identity with one prefill
in one arbitrary chunk order is not (docs/benchmarks/fidelity.md).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.fidelity.metrics import best_f1, normalize_answer

BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Score:
    """One answer against its gold answers: containment, exact match and token F1, each in [0,
    1]."""

    contains: float
    exact: float
    f1: float


def score_answer(answer: str, golds: Sequence[str]) -> Score:
    """The best score over `golds`; an empty gold list scores NaN (the case is not answerable)."""
    golds = [g for g in golds if normalize_answer(g)]
    if not golds:
        nan = float("nan")
        return Score(nan, nan, nan)
    said = normalize_answer(answer)
    contains = any(_contains_words(said, normalize_answer(g)) for g in golds)
    exact = any(said == normalize_answer(g) for g in golds)
    return Score(float(contains), float(exact), best_f1(answer, list(golds)))


def _contains_words(text: str, gold: str) -> bool:
    """`gold` occurs in `text` on word boundaries ("1764" is not in "17640")."""
    return f" {gold} " in f" {text} "


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap interval [low, high] at `CONFIDENCE`."""

    mean: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap(values: Sequence[float], seed: int = 0, samples: int = BOOTSTRAP_SAMPLES) -> Interval:
    """Mean of `values` with its percentile-bootstrap interval (seeded: the same values give the
    same interval). NaN values are left out; none left gives a NaN interval."""
    known = [v for v in values if v == v]
    if not known:
        nan = float("nan")
        return Interval(nan, nan, nan)
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(known, k=len(known))) for _ in range(samples))
    tail = (1 - CONFIDENCE) / 2
    low = means[int(tail * (samples - 1))]
    high = means[int((1 - tail) * (samples - 1))]
    return Interval(statistics.fmean(known), low, high)


def paired_difference(
    values: Sequence[float], reference: Sequence[float], seed: int = 0
) -> Interval:
    """`values` − `reference`, case by case (same cases, same orders), with its interval."""
    if len(values) != len(reference):
        raise ValueError(f"paired values differ in length: {len(values)} against {len(reference)}")
    return bootstrap([v - r for v, r in zip(values, reference)], seed)


def per_case_means(values: Sequence[float], cases: Sequence[int]) -> list[float]:
    """The mean of `values` per case (`cases[i]` names value i's case), in first-seen order."""
    grouped: dict[int, list[float]] = {}
    for case, value in zip(cases, values, strict=True):
        grouped.setdefault(case, []).append(value)
    return [statistics.fmean(v) for v in grouped.values()]
