"""`kvmosaic bench fidelity`: every mode on the same prompts, measured against `full`.

For each record: its first `chunks` passages become chunks, each with its base-variant KV
computed beforehand (as ingest would; not timed). Every mode prefills the same token
sequence; TTFT ratios are per record against `full` in the same run. A warm-up pass over the
first record runs before timing so that one-time allocation does not count.

`cachecraft` needs variants: before its timed run, each record's chunks go through
`warmup_orders` untimed `cachecraft` requests in other (seeded random) orders, whose new
variants land in a per-record `VariantBook`; 0 measures the cold case (base variants only).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from engine.bench.flops import FlopCounter
from engine.bench.metrics import best_f1, kl_divergence, rouge_l, same_top1
from engine.cachecraft.book import VariantBook
from engine.decode import SamplingParams
from engine.errors import InvalidRequest
from engine.planners.base import ChunkInput

REFERENCE = "full"
CRAFT = "cachecraft"


@dataclass(frozen=True)
class DatasetSlice:
    """Records [start, start + n) of a dataset, `chunks` passages each, and the Cache-Craft
    warm-up (`warmup_orders` untimed requests in other orders, seeded by `seed`)."""

    dataset: Path
    start: int = 0
    n: int = 20
    chunks: int = 6
    warmup_orders: int = 3
    seed: int = 0

    def records(self) -> list[dict]:
        """The slice's records; InvalidRequest if the file is unreadable or the slice empty."""
        records = load_dataset(self.dataset)[self.start:self.start + self.n]
        if not records:
            raise InvalidRequest("the dataset slice is empty")
        return records


@dataclass(frozen=True)
class FidelityOptions(DatasetSlice):
    modes: tuple[str, ...] = ("full", "naive", "epic", "cacheblend")
    ratio: float | None = None
    max_new_tokens: int = 32


@dataclass
class ModeSample:
    """One mode on one record."""

    ttft_s: float
    ttft_ratio: float
    compute_ratio: float  # FLOPs of full / FLOPs of this mode (engine/bench/flops.py)
    recompute_share: float
    kl: float
    top1: bool
    rouge_l: float
    f1: float
    answer: str


@dataclass
class ModeSummary:
    mode: str
    records: int
    median_ttft_s: float
    median_ttft_ratio: float
    median_compute_ratio: float  # the floor: the speed-up if nothing but the arithmetic cost time
    recompute_share: float
    mean_kl: float
    top1_agreement: float
    rouge_l: float
    f1: float
    samples: list[ModeSample] = field(default_factory=list)


ChunkProvider = Callable[[object, dict, int, int], list[ChunkInput]]


def load_dataset(path: Path) -> list[dict]:
    """A JSON list of {question, answers, ctxs: [{title, text}]}; raises InvalidRequest otherwise."""
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"cannot read dataset {path}: {exc}") from exc
    if not isinstance(records, list) or not all(_is_record(r) for r in records):
        raise InvalidRequest(f"{path} is not a list of {{question, answers, ctxs: [{{title, text}}]}}")
    return records


def _is_record(record) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("question"), str)
            and isinstance(record.get("ctxs"), list)
            and all(isinstance(c, dict) and "text" in c for c in record["ctxs"]))


def base_variant_chunks(engine, record: dict, count: int, index: int) -> list[ChunkInput]:
    """The record's first `count` passages with KV computed alone after the system prefix."""
    chunks = []
    for i, ctx in enumerate(record["ctxs"][:count]):
        ids = engine.chunk_ids(ctx["text"], ctx.get("title", ""))
        chunks.append(ChunkInput(f"r{index}-c{i}", ids, engine.encode_chunk(ids)))
    return chunks


def run_fidelity(engine, options: FidelityOptions, provider: ChunkProvider = base_variant_chunks,
                 progress: bool = True) -> list[ModeSummary]:
    records = options.records()
    modes = (REFERENCE,) + tuple(m for m in options.modes if m != REFERENCE)
    _warm_up(engine, records[0], options, modes, provider)
    samples: dict[str, list[ModeSample]] = {m: [] for m in modes}
    bar = tqdm(records, desc="fidelity", unit="record", file=sys.stderr, disable=not progress)
    for offset, record in enumerate(bar):
        index = options.start + offset
        inputs = mode_inputs(engine, record, options, modes, provider, index)
        for mode, sample in _run_record(engine, record, inputs, modes, options).items():
            samples[mode].append(sample)
        bar.set_postfix({m: f"{statistics.median(s.ttft_ratio for s in samples[m]):.1f}x"
                         for m in modes if m != REFERENCE})
    return [_summarize(mode, samples[mode]) for mode in modes]


def mode_inputs(engine, record, options: FidelityOptions, modes, provider, index: int) -> dict[str, list[ChunkInput]]:
    """The chunk inputs of every mode: base variants, or for cachecraft the book's choice."""
    base = provider(engine, record, options.chunks, index)
    inputs = {mode: base for mode in modes}
    if CRAFT in modes:
        book = warmed_book(engine, record["question"], base, options.warmup_orders, options.seed + index)
        inputs[CRAFT] = book.inputs([c.chunk_id for c in base])
    return inputs


def warmed_book(engine, question: str, base: list[ChunkInput], orders: int, seed: int) -> VariantBook:
    """A book holding the base variants plus what `orders` cachecraft requests in other
    orders of the same chunks produced (untimed)."""
    book = VariantBook(engine)
    for chunk in base:
        book.add(chunk.chunk_id, chunk.kv)
    ids = [c.chunk_id for c in base]
    for order in other_orders(ids, orders, seed):
        result = engine.prefill(book.inputs(order), question, mode=CRAFT, max_new_tokens=1)
        book.record(result)
    return book


def other_orders(ids: list[str], count: int, seed: int) -> list[list[str]]:
    """`count` seeded random orders of `ids`, none equal to `ids` itself (when possible)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(count):
        order = ids[:]
        for _ in range(10):
            rng.shuffle(order)
            if order != ids:
                break
        orders.append(order)
    return orders


def _warm_up(engine, record, options, modes, provider) -> None:
    inputs = mode_inputs(engine, record, dataclasses.replace(options, warmup_orders=min(1, options.warmup_orders)),
                         modes, provider, -1)
    for mode in modes:
        engine.prefill(inputs[mode], record["question"], mode=mode, ratio=options.ratio, max_new_tokens=1)


def _run_record(engine, record, inputs, modes, options) -> dict[str, ModeSample]:
    params = SamplingParams(max_new_tokens=options.max_new_tokens)
    flops = FlopCounter.for_engine(engine)
    reference = None
    out = {}
    for mode in modes:
        result = engine.prefill(inputs[mode], record["question"], mode=mode, ratio=options.ratio,
                                max_new_tokens=options.max_new_tokens)
        logits = result.logits.clone()
        work = flops.prefill(result.layers_computed)
        answer = "".join(engine.generate(result, params)).strip()
        if reference is None:
            reference = (result.ttft_s, work, logits, answer)
        ref_ttft, ref_work, ref_logits, ref_answer = reference
        out[mode] = ModeSample(
            ttft_s=result.ttft_s, ttft_ratio=ref_ttft / result.ttft_s, compute_ratio=ref_work / max(work, 1.0),
            recompute_share=result.recompute_share, kl=kl_divergence(ref_logits, logits),
            top1=same_top1(ref_logits, logits), rouge_l=rouge_l(answer, ref_answer),
            f1=best_f1(answer, record.get("answers", [])), answer=answer)
    return out


def _summarize(mode: str, samples: list[ModeSample]) -> ModeSummary:
    mean = statistics.fmean
    return ModeSummary(
        mode=mode, records=len(samples),
        median_ttft_s=statistics.median(s.ttft_s for s in samples),
        median_ttft_ratio=statistics.median(s.ttft_ratio for s in samples),
        median_compute_ratio=statistics.median(s.compute_ratio for s in samples),
        recompute_share=mean(s.recompute_share for s in samples),
        mean_kl=mean(s.kl for s in samples), top1_agreement=mean(s.top1 for s in samples),
        rouge_l=mean(s.rouge_l for s in samples), f1=mean(s.f1 for s in samples), samples=samples)


def format_table(summaries: list[ModeSummary]) -> str:
    header = f"{'mode':<11} {'n':>3} {'TTFT s':>8} {'vs full':>8} {'floor':>8} {'recomp':>7} {'KL':>8} {'top1':>6} {'ROUGE-L':>8} {'F1':>6}"
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(f"{s.mode:<11} {s.records:>3} {s.median_ttft_s:>8.3f} {s.median_ttft_ratio:>7.2f}x "
                     f"{s.median_compute_ratio:>7.2f}x {s.recompute_share:>7.3f} {s.mean_kl:>8.4f} {s.top1_agreement:>6.2f} "
                     f"{s.rouge_l:>8.3f} {s.f1:>6.3f}")
    return "\n".join(lines)


def write_json(summaries: list[ModeSummary], options: FidelityOptions, path: Path) -> None:
    payload = {"options": {**asdict(options), "dataset": str(options.dataset)},
               "modes": [asdict(s) for s in summaries]}
    Path(path).write_text(json.dumps(payload, indent=2))
