"""What the grounding check caught and what it cost, from a `kvmosaic bench fidelity` report
with `full`, a guarded blend without the check and the same blend with it (same cases and
orders): every request the check repaired, judged by what the blend answered without it.

  python -m bench.fidelity.grounding REPORT.json --off 'cacheblend[...;guard_grounding=false]' \
      --on 'cacheblend[...]'

A repair is a catch where the blend's answer without the check was wrong (no gold answer in
it) and not full's word for word; a false alarm where it was full's answer (full also gives
it); else "other" (it differed from full's but held a gold answer). Also: the wrong answers
of the unchecked blend that the check left alone (misses). Counts only; docs/benchmarks/guard.md
holds the figures.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

Sample = dict[str, Any]


def rows(path: Path) -> dict[str, dict[tuple[int, int], Sample]]:
    """Every row's samples of the report by (case, order)."""
    report = json.loads(path.read_text())
    return {
        row["mode"]: {(s["case"], s["order"]): s for s in row["samples"]} for row in report["modes"]
    }


def wrong(sample: Sample) -> bool:
    return bool(sample["score"]["contains"] == 0.0)


def kind(off: Sample) -> str:
    """What a grounding repair prevented, by the unchecked blend's answer."""
    if off["identical"]:
        return "false alarm"
    return "catch" if wrong(off) else "other"


def tally(off: dict[tuple[int, int], Sample], on: dict[tuple[int, int], Sample]) -> Counter[str]:
    counts: Counter[str] = Counter(samples=len(on))
    for key, checked in on.items():
        unchecked = off[key]
        counts["wrong without"] += wrong(unchecked)
        counts["wrong with"] += wrong(checked)
        if checked["repair_reason"] == "grounding":
            counts["grounding repairs"] += 1
            counts[kind(unchecked)] += 1
            counts["fixed"] += wrong(unchecked) and not wrong(checked)
        elif wrong(unchecked):
            counts["missed"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--off", required=True, help="the row without the grounding check")
    parser.add_argument("--on", required=True, help="the row with it")
    args = parser.parse_args()
    by_row = rows(args.report)
    counts = tally(by_row[args.off], by_row[args.on])
    for name, value in counts.items():
        print(f"{name}: {value}")
    spans = [s["repair_span"] for s in by_row[args.on].values() if s["repair_span"]]
    print("spans:", ", ".join(repr(span) for span in spans))


if __name__ == "__main__":
    main()
