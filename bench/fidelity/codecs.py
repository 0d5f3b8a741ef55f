"""`kvmosaic bench fidelity --store-codecs float16,int4,k4v3`: what a KV codec costs in fidelity.

Per record, the base-variant KV of its first `chunks` passages is computed once and `full`
prefills once (it reads no cached KV, so it is every codec's reference) and decodes its
greedy answer (`max_new_tokens`); then, per codec, every chunk's KV goes through the codec
(encoded as the store keeps it, decoded as a load does) and each reuse mode prefills the
same prompt from it. Against full, per mode and codec: first-token KL(full ‖ mode) and top-1
agreement, and along full's answer fed to the mode (teacher forcing, `teacher_forced`) the
share of answer positions whose top-1 is full's token and their mean KL. The change of these
between codecs is the codec's fidelity cost on the same requests. Bytes per token are the
stored payload of the record chunks over their tokens.

Only full decodes; the modes only prefill and follow its answer (no timing): this is a
fidelity measurement. Chunks reuse their base variants (a cold `cachecraft` request), as
right after ingest.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from app.store.entry import entry_from_chunk, roundtrip
from app.store.quant import get_codec
from bench.fidelity.fidelity import REFERENCE, DatasetSlice, base_variant_chunks
from bench.fidelity.metrics import forced_logits, kl_divergence, same_top1, teacher_forced
from engine.config import Fidelity
from engine.decoding import read_out
from engine.engine import Engine
from engine.kv import ChunkKV
from engine.model.decode import SamplingParams
from engine.plan import ChunkInput
from engine.planners import Mode, reference_mode
from engine.result import PrefillResult


@dataclass(frozen=True)
class CodecOptions(DatasetSlice):
    codecs: tuple[str, ...] = ("float16", "int8", "int4", "k4v3")
    modes: tuple[str, ...] = ("cacheblend", "cachecraft")
    ratio: float | None = None
    max_new_tokens: int = 32  # length of full's greedy answer that the modes follow
    fidelity: str | None = None  # the modes' guard level (None: the engine's default)


@dataclass
class CodecRow:
    """One mode under one codec over the records."""

    codec: str
    mode: str
    kl: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    # per record, along full's answer: share of positions whose top-1 is full's token, mean KL
    # (NaN where full's answer is empty)
    answer_top1: list[float] = field(default_factory=list)
    answer_kl: list[float] = field(default_factory=list)
    escalated: list[bool] = field(default_factory=list)  # the guard re-ran the record in full

    @property
    def escalated_share(self) -> float:
        return statistics.fmean(self.escalated)

    @property
    def mean_kl(self) -> float:
        return statistics.fmean(self.kl)

    @property
    def top1_agreement(self) -> float:
        return statistics.fmean(self.top1)

    @property
    def answer_top1_agreement(self) -> float:
        """Mean over records (as `bench fidelity`'s `ans top1`)."""
        return _mean_known(self.answer_top1)

    @property
    def mean_answer_kl(self) -> float:
        return _mean_known(self.answer_kl)


def paired_kl_change(row: CodecRow, baseline: CodecRow) -> tuple[float, float]:
    """Mean change of first-token KL from `baseline` over the same records, and its standard
    error (0 with fewer than two records). On a blend, any perturbation of the cached KV can
    reorder which rows are recomputed, so per-record changes scatter both ways: a mean change
    smaller than about two standard errors is not a measured cost."""
    changes = [a - b for a, b in zip(row.kl, baseline.kl, strict=True)]
    error = statistics.stdev(changes) / math.sqrt(len(changes)) if len(changes) > 1 else 0.0
    return statistics.fmean(changes), error


def _mean_known(values: list[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.fmean(known) if known else float("nan")


@dataclass
class CodecReport:
    codecs: tuple[str, ...]
    bytes_per_token: dict[str, float]
    rows: list[CodecRow]

    def row(self, codec: str, mode: str) -> CodecRow:
        return next(r for r in self.rows if r.codec == codec and r.mode == mode)


def run_codec_fidelity(engine: Engine, options: CodecOptions, progress: bool = True) -> CodecReport:
    """Every mode under every codec on the same records; the first codec is the baseline."""
    if not options.codecs or not options.modes:
        raise ValueError("name at least one codec and one mode")
    for codec in options.codecs:
        get_codec(codec)  # unknown names fail before any work
    modes = tuple(m for m in options.modes if m != REFERENCE)
    rows = {(c, m): CodecRow(c, m) for c in options.codecs for m in modes}
    stored = dict.fromkeys(options.codecs, 0)
    tokens = 0
    records = options.records()
    answer_length = options.max_new_tokens
    for offset, record in enumerate(
        tqdm(records, desc="codecs", unit="record", file=sys.stderr, disable=not progress)
    ):
        base = base_variant_chunks(engine, record, options.chunks, options.start + offset)
        question = record["question"]
        reference = engine.prefill(base, question, reference_mode(), max_new_tokens=answer_length)
        full = reference.logits.clone()
        answer, full_forced = _full_answer(engine, reference, answer_length)
        kvs = [_base_kv(c) for c in base]
        tokens += sum(kv.num_tokens for kv in kvs)
        for codec in options.codecs:
            stored[codec] += sum(entry_from_chunk(kv, codec).num_bytes for kv in kvs)
            inputs = [dataclasses.replace(c, kv=roundtrip(kv, codec)) for c, kv in zip(base, kvs)]
            for mode in modes:
                result = engine.prefill(
                    inputs,
                    question,
                    Mode.named(mode),
                    Fidelity.named(options.fidelity) if options.fidelity else None,
                    ratio=options.ratio,
                    max_new_tokens=answer_length,
                )
                row = rows[codec, mode]
                row.kl.append(kl_divergence(full, result.logits))
                row.top1.append(same_top1(full, result.logits))
                forced = teacher_forced(engine, result, answer, full_forced)
                row.answer_top1.append(forced.top1_share)
                row.answer_kl.append(forced.mean_kl)
                row.escalated.append(result.guard.escalated)
        if progress:  # running figures, so a run cut short still says something
            tqdm.write(
                f"after {offset + 1} records: "
                + "; ".join(
                    f"{r.mode}/{r.codec} KL {r.mean_kl:.4f} top1 {r.top1_agreement:.2f} "
                    f"ans top1 {r.answer_top1_agreement:.3f} guard {r.escalated_share:.2f}"
                    for r in rows.values()
                ),
                file=sys.stderr,
            )
    return CodecReport(
        options.codecs, {c: b / max(tokens, 1) for c, b in stored.items()}, list(rows.values())
    )


def _full_answer(
    engine: Engine, reference: PrefillResult, length: int
) -> tuple[list[int], torch.Tensor]:
    """full's greedy answer (ids) and its logits predicting each of them [len(ids), vocab]."""
    _, decoded = read_out(engine.generate(reference, SamplingParams(max_new_tokens=length)))
    ids = list(decoded.token_ids)
    return ids, forced_logits(engine, reference, ids)


def format_codec_table(report: CodecReport) -> str:
    """Per mode and codec: bytes/token (and against the baseline), first-token mean KL and
    top-1 against full, answer-position top-1 and mean KL (teacher forcing), the change of
    each from the baseline codec on the same requests, and the share of records the fidelity
    guard re-ran in full (those match full: a codec that trips the guard more looks closer to
    full here and pays in TTFT)."""
    base = report.codecs[0]
    header = (
        f"{'mode':<11} {'codec':<9} {'B/token':>8} {'vs ' + base:>11} {'KL':>8} {'dKL':>8} "
        f"{'s.e.':>7} "
        f"{'top1':>6} {'dtop1':>7} {'ans top1':>8} {'dans':>7} {'ans KL':>7} {'dansKL':>8} "
        f"{'guard':>6}"
    )
    lines = [header, "-" * len(header)]
    for mode in dict.fromkeys(r.mode for r in report.rows):
        reference = report.row(base, mode)
        for codec in report.codecs:
            row, size = report.row(codec, mode), report.bytes_per_token[codec]
            change, error = paired_kl_change(row, reference)
            lines.append(
                f"{mode:<11} {codec:<9} {size:>8.0f} {size / report.bytes_per_token[base]:>10.3f}x "
                f"{row.mean_kl:>8.4f} {change:>+8.4f} {error:>7.4f} "
                f"{row.top1_agreement:>6.3f} "
                f"{row.top1_agreement - reference.top1_agreement:>+7.3f} "
                f"{row.answer_top1_agreement:>8.3f} "
                f"{row.answer_top1_agreement - reference.answer_top1_agreement:>+7.3f} "
                f"{row.mean_answer_kl:>7.4f} "
                f"{row.mean_answer_kl - reference.mean_answer_kl:>+8.4f} "
                f"{row.escalated_share:>6.2f}"
            )
    return "\n".join(lines)


def _base_kv(chunk: ChunkInput) -> ChunkKV:
    """The computed base KV of a chunk (`base_variant_chunks` always computes one)."""
    if not isinstance(chunk.kv, ChunkKV):
        raise TypeError(f"chunk {chunk.chunk_id} carries no computed KV")
    return chunk.kv


def codec_json(report: CodecReport) -> dict[str, object]:
    base = report.codecs[0]
    return {
        "codecs": list(report.codecs),
        "bytes_per_token": report.bytes_per_token,
        "rows": [
            {
                "codec": r.codec,
                "mode": r.mode,
                "mean_kl": r.mean_kl,
                "top1_agreement": r.top1_agreement,
                "kl_change_standard_error": paired_kl_change(r, report.row(base, r.mode))[1],
                "answer_top1_agreement": r.answer_top1_agreement,
                "mean_answer_kl": r.mean_answer_kl,
                "escalated_share": r.escalated_share,
                "escalated": r.escalated,
                "kl": r.kl,
                "top1": r.top1,
                "answer_top1": r.answer_top1,
                "answer_kl": r.answer_kl,
            }
            for r in report.rows
        ],
    }
