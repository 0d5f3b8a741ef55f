"""`kvmosaic bench fidelity`: every mode on the same prompts, measured against `full`.

For each record: its first `chunks` passages become chunks, each with its base-variant KV
computed beforehand (as ingest would; not timed). Every mode prefills the same token
sequence; TTFT ratios are per record against `full` in the same run. A warm-up pass over the
first record runs before timing so that one-time allocation does not count.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from engine.bench.metrics import best_f1, kl_divergence, rouge_l, same_top1
from engine.decode import SamplingParams
from engine.errors import InvalidRequest
from engine.planners.base import ChunkInput

REFERENCE = "full"


@dataclass(frozen=True)
class FidelityOptions:
    dataset: Path
    start: int = 0
    n: int = 20
    chunks: int = 6
    modes: tuple[str, ...] = ("full", "naive", "epic", "cacheblend")
    ratio: float | None = None
    max_new_tokens: int = 32


@dataclass
class ModeSample:
    """One mode on one record."""

    ttft_s: float
    ttft_ratio: float
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
    records = load_dataset(options.dataset)[options.start:options.start + options.n]
    if not records:
        raise InvalidRequest("the dataset slice is empty")
    modes = (REFERENCE,) + tuple(m for m in options.modes if m != REFERENCE)
    _warm_up(engine, records[0], options, modes, provider)
    samples: dict[str, list[ModeSample]] = {m: [] for m in modes}
    bar = tqdm(records, desc="fidelity", unit="record", file=sys.stderr, disable=not progress)
    for offset, record in enumerate(bar):
        chunks = provider(engine, record, options.chunks, options.start + offset)
        for mode, sample in _run_record(engine, record, chunks, modes, options).items():
            samples[mode].append(sample)
        bar.set_postfix({m: f"{statistics.median(s.ttft_ratio for s in samples[m]):.1f}x"
                         for m in modes if m != REFERENCE})
    return [_summarize(mode, samples[mode]) for mode in modes]


def _warm_up(engine, record, options, modes, provider) -> None:
    chunks = provider(engine, record, options.chunks, -1)
    for mode in modes:
        engine.prefill(chunks, record["question"], mode=mode, ratio=options.ratio, max_new_tokens=1)


def _run_record(engine, record, chunks, modes, options) -> dict[str, ModeSample]:
    params = SamplingParams(max_new_tokens=options.max_new_tokens)
    reference = None
    out = {}
    for mode in modes:
        result = engine.prefill(chunks, record["question"], mode=mode, ratio=options.ratio,
                                max_new_tokens=options.max_new_tokens)
        logits = result.logits.clone()
        answer = "".join(engine.generate(result, params)).strip()
        if reference is None:
            reference = (result.ttft_s, logits, answer)
        ref_ttft, ref_logits, ref_answer = reference
        out[mode] = ModeSample(
            ttft_s=result.ttft_s, ttft_ratio=ref_ttft / result.ttft_s,
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
        recompute_share=mean(s.recompute_share for s in samples),
        mean_kl=mean(s.kl for s in samples), top1_agreement=mean(s.top1 for s in samples),
        rouge_l=mean(s.rouge_l for s in samples), f1=mean(s.f1 for s in samples), samples=samples)


def format_table(summaries: list[ModeSummary]) -> str:
    header = f"{'mode':<11} {'n':>3} {'TTFT s':>8} {'vs full':>8} {'recomp':>7} {'KL':>8} {'top1':>6} {'ROUGE-L':>8} {'F1':>6}"
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(f"{s.mode:<11} {s.records:>3} {s.median_ttft_s:>8.3f} {s.median_ttft_ratio:>7.2f}x "
                     f"{s.recompute_share:>7.3f} {s.mean_kl:>8.4f} {s.top1_agreement:>6.2f} "
                     f"{s.rouge_l:>8.3f} {s.f1:>6.3f}")
    return "\n".join(lines)


def write_json(summaries: list[ModeSummary], options: FidelityOptions, path: Path) -> None:
    payload = {"options": {**asdict(options), "dataset": str(options.dataset)},
               "modes": [asdict(s) for s in summaries]}
    Path(path).write_text(json.dumps(payload, indent=2))
