"""The rule that decides a model's reuse profile from a fidelity run (docs/benchmarks/profiles.md).

A row `MODE[reuse_profile=off;...]` at `balanced` passes when its paired accuracy difference
against full has a 95% interval containing 0 and its first-token KL and ROUGE-L shortfall are
inside full's own reorder floor, on at least `MIN_CASES` tuning cases; with fewer cases a row
can only fail. `decide` turns a fidelity report's JSON into the profile and the record of its
trials; it runs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

from bench.fidelity.fidelity import FLOOR, REFERENCE, mode_of, settings_of
from engine.serving.profile import GUARD_FIELDS, ReuseProfile

MIN_CASES = 100  # cases a pass needs (both orders each)
RULE = (
    "balanced passes a mode when, on >= 100 tuning cases x their orders, cold, its paired "
    "accuracy difference vs full has a 95% interval containing 0 and its KL/floor and "
    "1-RL/fl are <= 1.00 (docs/benchmarks/profiles.md)"
)


@dataclass(frozen=True)
class Trial:
    """One row of the run judged by the rule."""

    row: str
    mode: str
    cases: int
    accuracy_diff: tuple[float, float, float]  # mean, low, high
    kl_over_floor: float | None  # None: infinite (a deviation over a floor of zero)
    miss_over_floor: float | None
    passed: bool
    why: str


def judge_rows(payload: Mapping[str, Any]) -> list[Trial]:
    """Every balanced row of a fidelity report (`bench fidelity --json`) judged by the rule;
    ValueError when the report has no floor (it needs at least two chunk orders)."""
    rows = {row["mode"]: row for row in payload["modes"]}
    floor = rows.get(FLOOR)
    if floor is None:
        raise ValueError("the run has no reorder floor: run it with --orders 2 or more")
    default_level = payload["options"].get("fidelity")
    return [
        _judge(label, row, floor)
        for label, row in rows.items()
        if label not in (REFERENCE, FLOOR) and _is_balanced(label, default_level)
    ]


def _is_balanced(label: str, default_level: str | None) -> bool:
    head = label.split("[")[0]
    level = head.split("@")[1] if "@" in head else (default_level or "balanced")
    return level == "balanced"


def _judge(label: str, row: Mapping[str, Any], floor: Mapping[str, Any]) -> Trial:
    diff = row["accuracy_vs_full"]
    kl_ratio = _over(row["mean_kl"], floor["mean_kl"])
    miss_ratio = _over(1 - row["rouge_l"], 1 - floor["rouge_l"])
    faults = []
    if not diff["low"] <= 0.0 <= diff["high"]:
        faults.append(f"accuracy {diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]")
    if kl_ratio > 1.0:
        faults.append(f"KL {_times(kl_ratio)} the floor")
    if miss_ratio > 1.0:
        faults.append(f"ROUGE-L shortfall {_times(miss_ratio)} the floor")
    if not faults and row["records"] < MIN_CASES:
        faults.append(f"only {row['records']} cases (a pass needs {MIN_CASES})")
    return Trial(
        row=label,
        mode=mode_of(label).name,
        cases=row["records"],
        accuracy_diff=(diff["mean"], diff["low"], diff["high"]),
        kl_over_floor=_finite(kl_ratio),
        miss_over_floor=_finite(miss_ratio),
        passed=not faults,
        why="; ".join(faults) or "inside full's interval and floor",
    )


def _over(value: float, floor: float) -> float:
    """`value` as a multiple of `floor`; a floor of zero allows only zero."""
    if floor > 0:
        return value / floor
    return 0.0 if value <= 0 else math.inf


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "above a zero"


def _finite(ratio: float) -> float | None:
    return round(ratio, 4) if math.isfinite(ratio) else None


def decide(
    payload: Mapping[str, Any], model: str, evidence: str, cases: Mapping[str, Any]
) -> tuple[ReuseProfile, dict[str, Any]]:
    """The profile the rule gives for `model` from a fidelity report, and the record written
    beside it (`cases`: where the tuning cases came from)."""
    trials = judge_rows(payload)
    passed = _first_pass_per_mode(trials)
    guard = {}
    for trial in passed:  # the thresholds the passing rows named (one set: the first row's)
        guard = {k: float(v) for k, v in settings_of(trial.row).items() if k in GUARD_FIELDS}
        break
    profile = ReuseProfile(
        model=model,
        balanced_modes=tuple(t.mode for t in passed),
        guard=MappingProxyType(guard),
        evidence=evidence,
    )
    record = {
        "rule": RULE,
        "cases": dict(cases),
        "options": {k: payload["options"].get(k) for k in ("n", "orders", "max_new_tokens")},
        "trials": [asdict(t) for t in trials],
    }
    return profile, record


def _first_pass_per_mode(trials: Sequence[Trial]) -> list[Trial]:
    seen: set[str] = set()
    out = []
    for trial in trials:
        if trial.passed and trial.mode not in seen:
            seen.add(trial.mode)
            out.append(trial)
    return out
