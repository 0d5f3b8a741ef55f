"""Merge `bench fidelity` shards: runs of the same rows over disjoint case ranges, one report.

A report over hundreds of cases takes hours on a small machine; it runs as shards (each its own
process, core or machine, `--start`/`--n`), and each shard's JSON keeps every sample. The
merged summaries (means, medians, bootstrap intervals over cases, paired differences against
full) are computed from all the samples, as one run over every case would compute them. A
sample's TTFT ratio is measured inside its own shard, against full on the same case and order.
Shards must agree on everything but their case range, and their ranges must not overlap.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fidelity.accuracy import Interval, Score, paired_difference, per_case_means
from bench.fidelity.fidelity import ModeSample, ModeSummary, summarize_rows
from engine.errors import InvalidRequest

# options a shard may differ in (its case range); every other option must be the same
RANGE_OPTIONS = ("start", "n")


@dataclass(frozen=True)
class Shard:
    """One `bench fidelity --json` file: its options, row labels in order, samples per row."""

    path: Path
    options: dict[str, Any]
    labels: tuple[str, ...]
    samples: dict[str, list[ModeSample]]

    @property
    def cases(self) -> range:
        return range(self.options["start"], self.options["start"] + self.options["n"])


def load_shard(path: Path) -> Shard:
    """Read a shard; a file that is not a fidelity report with samples is a clear error."""
    try:
        payload = json.loads(Path(path).read_text())
        options, modes = payload["options"], payload["modes"]
        samples = {m["mode"]: [_sample(s) for s in m["samples"]] for m in modes}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"{path}: not a `bench fidelity --json` report ({exc})") from exc
    return Shard(Path(path), options, tuple(options["modes"]), samples)


def _sample(fields: dict[str, Any]) -> ModeSample:
    return ModeSample(**{**fields, "score": Score(**fields["score"])})


def merge_shards(shards: Sequence[Shard]) -> tuple[dict[str, Any], list[ModeSummary]]:
    """The merged options (start: the first case, n: cases in all, `shards`: each file's range)
    and the summaries over every shard's samples."""
    if not shards:
        raise InvalidRequest("no shards to merge")
    _check_compatible(shards)
    labels = shards[0].labels
    samples: dict[str, list[ModeSample]] = {}
    for shard in shards:
        for label, rows in shard.samples.items():
            samples.setdefault(label, []).extend(rows)
    options = {
        **shards[0].options,
        "start": min(s.cases.start for s in shards),
        "n": sum(len(s.cases) for s in shards),
        "shards": [
            {"path": str(s.path), "start": s.cases.start, "n": len(s.cases)} for s in shards
        ],
    }
    return options, summarize_rows(samples, labels)


def _check_compatible(shards: Sequence[Shard]) -> None:
    first = shards[0]
    fixed = {k: v for k, v in first.options.items() if k not in RANGE_OPTIONS}
    for shard in shards[1:]:
        other = {k: v for k, v in shard.options.items() if k not in RANGE_OPTIONS}
        differing = sorted(k for k in fixed.keys() | other.keys() if fixed.get(k) != other.get(k))
        if differing:
            raise InvalidRequest(
                f"{shard.path} differs from {first.path} in {', '.join(differing)}: "
                "only the case range may differ"
            )
    ordered = sorted(shards, key=lambda s: s.cases.start)
    for before, after in zip(ordered, ordered[1:]):
        if after.cases.start < before.cases.stop:
            raise InvalidRequest(
                f"{before.path} (cases {before.cases.start}..{before.cases.stop - 1}) and "
                f"{after.path} (from {after.cases.start}) overlap"
            )


def paired_rows(summaries: Sequence[ModeSummary], row: str, against: str) -> Interval:
    """Accuracy of `row` − `against`, case by case over the (case, order)s both ran (each
    case's mean over its orders), with its 95% interval; InvalidRequest for an unknown row."""
    by_label = {s.mode: s for s in summaries}
    for label in (row, against):
        if label not in by_label:
            raise InvalidRequest(f"no row {label!r}; rows: {', '.join(by_label)}")
    theirs = {(s.case, s.order): s.score.contains for s in by_label[against].samples}
    mine = [s for s in by_label[row].samples if (s.case, s.order) in theirs]
    cases = [s.case for s in mine]
    return paired_difference(
        per_case_means([s.score.contains for s in mine], cases),
        per_case_means([theirs[(s.case, s.order)] for s in mine], cases),
    )
