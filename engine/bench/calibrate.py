"""`kvmosaic calibrate`: fit Cache-Craft's α on a dataset slice to a fidelity target.

Per record: the full-prefill reference, then a variant book warmed by `warmup_orders`
cachecraft requests in other orders (as in `bench fidelity`), then one cachecraft prefill
per candidate α. α scales every chunk's recompute budget (CFO = α·CCI·(1 − β′·ν)), so the
curve trades recomputed tokens for KL; the fit is the smallest α whose mean KL meets the
target (the cheapest one that is good enough).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass

from tqdm import tqdm

from engine.bench.fidelity import CRAFT, DatasetSlice, base_variant_chunks, warmed_book
from engine.bench.metrics import kl_divergence, same_top1
from engine.errors import InvalidRequest


@dataclass(frozen=True)
class CalibrateOptions(DatasetSlice):
    alphas: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
    target_kl: float = 0.05


@dataclass(frozen=True)
class CurvePoint:
    alpha: float
    mean_kl: float
    top1_agreement: float
    recompute_share: float
    median_ttft_ratio: float


def run_calibration(engine, options: CalibrateOptions, progress: bool = True) -> list[CurvePoint]:
    if not options.alphas:
        raise InvalidRequest("calibration needs at least one alpha")
    records = options.records()
    rows: dict[float, list[tuple[float, bool, float, float]]] = {a: [] for a in options.alphas}
    configured = engine.config
    try:
        for offset, record in enumerate(tqdm(records, desc="calibrate", unit="record", file=sys.stderr,
                                             disable=not progress)):
            _measure_record(engine, configured, record, options, options.start + offset, rows)
    finally:
        engine.config = configured
    return [CurvePoint(a, statistics.fmean(r[0] for r in rows[a]), statistics.fmean(r[1] for r in rows[a]),
                       statistics.fmean(r[2] for r in rows[a]), statistics.median(r[3] for r in rows[a]))
            for a in options.alphas]


def _measure_record(engine, configured, record, options: CalibrateOptions, index: int, rows) -> None:
    """Full, the warm-up and one cachecraft prefill per α; `configured` is the engine's own config."""
    engine.config = configured
    base = base_variant_chunks(engine, record, options.chunks, index)
    question = record["question"]
    full = engine.prefill(base, question, mode="full", max_new_tokens=1)
    book = warmed_book(engine, question, base, options.warmup_orders, options.seed + index)
    ids = [c.chunk_id for c in base]
    for alpha in options.alphas:
        engine.config = dataclasses.replace(configured, craft_alpha=alpha)
        result = engine.prefill(book.inputs(ids), question, mode=CRAFT, max_new_tokens=1)
        rows[alpha].append((kl_divergence(full.logits, result.logits), same_top1(full.logits, result.logits),
                            result.recompute_share, full.ttft_s / result.ttft_s))


def fit_alpha(points: list[CurvePoint], target_kl: float) -> tuple[CurvePoint, bool]:
    """(the smallest α meeting the target, True), or (the α of lowest KL, False) if none does."""
    meeting = [p for p in points if p.mean_kl <= target_kl]
    if meeting:
        return min(meeting, key=lambda p: p.alpha), True
    return min(points, key=lambda p: p.mean_kl), False


def format_curve(points: list[CurvePoint]) -> str:
    header = f"{'alpha':>7} {'KL':>8} {'top1':>6} {'recomp':>7} {'vs full':>8}"
    lines = [header, "-" * len(header)]
    for p in points:
        lines.append(f"{p.alpha:>7.3f} {p.mean_kl:>8.4f} {p.top1_agreement:>6.2f} {p.recompute_share:>7.3f} "
                     f"{p.median_ttft_ratio:>7.2f}x")
    return "\n".join(lines)
