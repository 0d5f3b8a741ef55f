"""`kvmosaic calibrate`: fit Cache-Craft's α on a dataset slice to a fidelity target.

α scales every chunk's fix budget (CFO = α·CCI·(1 − β′·ν)), and with it which variant wins:
a variant is used only while its CFO is below the cost of fixing the base variant by
deviation (`VariantPolicy.blend_cost`), so a larger α fixes more tokens of the variants it
keeps and hands more chunks back to the blend fix.

It is calibrated on variants as a workload leaves them, not on the same chunks in other
orders: per record, `warmup_orders` untimed cachecraft requests (each with its exact variants
built) run over chunk lists that share only part of the record's chunks (`swap` of them
replaced by chunks of the next record in the slice, in seeded random order), as reformulated
questions retrieve. Then per record: the `full` reference, `cacheblend` on base variants (the
fallback every chunk has), and one cachecraft prefill per candidate α, each choosing its
variants through the policy at that α. The fit is the smallest α whose mean KL meets the
target: by default cacheblend's own mean KL on the same records (variants may save work, never
fidelity).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
from dataclasses import dataclass

from tqdm import tqdm

from app.variants.book import VariantBook
from app.variants.policy import VariantPolicy
from bench.fidelity.fidelity import CRAFT, DatasetSlice, Record, base_variant_chunks, computed_kv
from bench.fidelity.metrics import kl_divergence, same_top1
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.plan import ChunkInput
from engine.planners import Mode, reference_mode
from engine.result import PrefillResult

BLEND = "cacheblend"

# per request: KL, top-1, recompute share, TTFT ratio against full, share of chunks from a variant
Row = tuple[float, float, float, float, float]


@dataclass(frozen=True)
class CalibrateOptions(DatasetSlice):
    alphas: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0)
    target_kl: float | None = None  # None: cacheblend's mean KL on the same records
    warmup_orders: int = 3
    swap: int = 2  # chunks of each warm-up request that come from another record


@dataclass(frozen=True)
class CurvePoint:
    alpha: float
    mean_kl: float
    top1_agreement: float
    recompute_share: float
    median_ttft_ratio: float
    variant_share: float = 0.0  # chunks served from a context variant (not the base)


def run_calibration(
    engine: Engine, options: CalibrateOptions, progress: bool = True
) -> tuple[list[CurvePoint], CurvePoint]:
    """(the curve over the candidate αs, cacheblend's point on the same records as `alpha` 0)."""
    if not options.alphas:
        raise InvalidRequest("calibration needs at least one alpha")
    if not 0 <= options.swap < options.chunks:
        raise InvalidRequest(
            f"swap must lie in [0, chunks); got {options.swap} of {options.chunks}"
        )
    records = options.records()
    rows: dict[float, list[Row]] = {a: [] for a in (*options.alphas, -1.0)}
    for offset, record in enumerate(
        tqdm(records, desc="calibrate", unit="record", file=sys.stderr, disable=not progress)
    ):
        other = records[(offset + 1) % len(records)]
        _measure_record(engine, record, other, options, options.start + offset, rows)
    curve = [_point(a, rows[a]) for a in options.alphas]
    return curve, _point(0.0, rows[-1.0])


def _point(alpha: float, rows: list[Row]) -> CurvePoint:
    mean = statistics.fmean
    return CurvePoint(
        alpha,
        mean(r[0] for r in rows),
        mean(r[1] for r in rows),
        mean(r[2] for r in rows),
        statistics.median(r[3] for r in rows),
        mean(r[4] for r in rows),
    )


def _measure_record(
    engine: Engine,
    record: Record,
    other: Record,
    options: CalibrateOptions,
    index: int,
    rows: dict[float, list[Row]],
) -> None:
    """Full, cacheblend, the workload-like warm-up and one cachecraft prefill per α.

    Each α is a per-call config (`Engine.prefill(config=...)`): the engine's own config, which
    other threads may be reading, is never swapped."""
    base = base_variant_chunks(engine, record, options.chunks, index)
    foreign = base_variant_chunks(engine, other, options.swap, 10_000 + index)
    question = record["question"]
    full = engine.prefill(base, question, reference_mode(), max_new_tokens=1)
    blend = engine.prefill(base, question, Mode.named(BLEND), max_new_tokens=1)
    rows[-1.0].append(_row(full, blend))
    book = related_book(
        engine, question, base, foreign, options.warmup_orders, options.seed + index
    )
    ids = [c.chunk_id for c in base]
    craft = Mode.named(CRAFT)
    for alpha in options.alphas:
        config = dataclasses.replace(engine.config, craft_alpha=alpha)
        policy = VariantPolicy(config, engine.loaded.spec.num_layers)
        result = engine.prefill(
            book.inputs(ids, craft, policy), question, craft, max_new_tokens=1, config=config
        )
        rows[alpha].append(_row(full, result))


def _row(full: PrefillResult, result: PrefillResult) -> Row:
    variants = sum(1 for c in result.chunks if c.variant) / max(1, len(result.chunks))
    return (
        kl_divergence(full.logits, result.logits),
        same_top1(full.logits, result.logits),
        result.recompute_share,
        full.ttft_s / result.ttft_s,
        variants,
    )


def related_book(
    engine: Engine,
    question: str,
    base: list[ChunkInput],
    foreign: list[ChunkInput],
    orders: int,
    seed: int,
) -> VariantBook:
    """A book warmed by `orders` cachecraft requests over the record's chunks with
    `len(foreign)` of them replaced by `foreign` ones, in random order; every request's exact
    variants are built (the policy's recurrence rule is off here: each context is new)."""
    config = dataclasses.replace(engine.config, craft_build_after=0)
    book = VariantBook(engine, policy=VariantPolicy(config, engine.loaded.spec.num_layers))
    for chunk in [*base, *foreign]:
        book.add(chunk.chunk_id, computed_kv(chunk))
    rng, craft = random.Random(seed), Mode.named(CRAFT)
    for _ in range(orders):
        kept = rng.sample(base, len(base) - len(foreign))
        chunks = kept + list(foreign)
        rng.shuffle(chunks)
        ids = [c.chunk_id for c in chunks]
        inputs = book.inputs(ids, craft)
        book.record(engine.prefill(inputs, question, craft, max_new_tokens=1), inputs)
    return book


def fit_alpha(points: list[CurvePoint], target_kl: float) -> tuple[CurvePoint, bool]:
    """(the smallest α meeting the target, True), or (the α of lowest KL, False) if none does."""
    meeting = [p for p in points if p.mean_kl <= target_kl]
    if meeting:
        return min(meeting, key=lambda p: p.alpha), True
    return min(points, key=lambda p: p.mean_kl), False


def format_curve(points: list[CurvePoint], blend: CurvePoint | None = None) -> str:
    header = f"{'alpha':>10} {'KL':>8} {'top1':>6} {'recomp':>7} {'vs full':>8} {'variants':>9}"
    lines = [header, "-" * len(header)]
    if blend is not None:
        lines.append(
            f"{'cacheblend':>10} {blend.mean_kl:>8.4f} {blend.top1_agreement:>6.2f} "
            f"{blend.recompute_share:>7.3f} {blend.median_ttft_ratio:>7.2f}x {'':>9}"
        )
    for p in points:
        lines.append(
            f"{p.alpha:>10.3f} {p.mean_kl:>8.4f} {p.top1_agreement:>6.2f} "
            f"{p.recompute_share:>7.3f} "
            f"{p.median_ttft_ratio:>7.2f}x {p.variant_share:>8.1%}"
        )
    return "\n".join(lines)
