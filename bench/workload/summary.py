"""Per-cell figures: throughput, latency percentiles, work, tier hits and fidelity against `full`.

Fidelity compares each request with `full`'s answer to the same trace request, only where
both retrieved the same chunks in the same order (always, unless the index changed): exact
match and ROUGE-L of the greedy answers, first-token KL(full ‖ mode) and top-1 agreement.
Work shares compare a cell's model work per request with `full`'s and `prefix`'s at the same
load; background work (variant builds, base KV computed on a miss) is included.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from bench.fidelity.metrics import kl_divergence, normalize_answer, rouge_l, same_top1
from bench.workload.cell import CellResult, RequestFacts
from bench.workload.served import served_shares


@dataclass(frozen=True)
class Fidelity:
    """Against `full` on the same requests; answer_* follow full's answer by teacher forcing
    (pooled over answer positions; NaN when it was not measured)."""

    compared: int
    exact_match: float
    rouge_l: float
    first_kl: float
    first_top1: float
    answer_top1: float
    answer_kl: float


@dataclass(frozen=True)
class CellSummary:
    mode: str
    load: str
    clients: int | None
    rate: float | None
    requests: int
    errors: int
    rejections: int
    first_error: str | None
    throughput: float  # answered requests per second of wall time (background drain included)
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    engine_ttft_p50: float  # load + prefill on the worker, without queue wait
    latency_p50: float
    latency_p95: float
    output_tokens_per_s: float
    decode_tokens_per_s: (
        float  # tokens after each answer's first, per second while any request decoded
    )
    cpu_s_per_request: float
    gflops_per_request: float
    work_vs_full: float | None
    work_vs_prefix: float | None
    background_share: float  # share of the work done off the request path (variant builds)
    recompute_share: float
    escalated_share: float  # requests the fidelity guard re-ran in full at the first token
    repaired_share: float  # requests whose decode the guard moved to full prefill
    skipped_share: float  # requests that skipped their blend for an exact prefill, the engine busy
    computed_now: int
    drain_s: float
    tier_hits: dict
    # the store's KV bytes after the cell, by kind and codec (base:<codec>, context:<codec>)
    kv_bytes: dict
    fidelity: Fidelity | None
    ttfts: list[float]  # every answered request's client TTFT, in trace order (for the CDF)
    per_request: list[dict]  # `request_rows`: what each answered request did, for analysis
    served: dict = field(
        default_factory=dict
    )  # shares of context tokens served exact / blended / computed
    reordered_share: float = 0.0  # requests whose chunks the order stage moved off retrieval order

    def as_dict(self) -> dict:
        return asdict(self)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    cell: CellResult,
    flops_of,
    reference: dict[int, RequestFacts] | None,
    baselines: dict[str, float],
) -> CellSummary:
    """Figures of one cell; `reference` is full's facts by trace index (None: no fidelity),
    `baselines` FLOPs per request of `full` / `prefix` at this load (when they ran)."""
    facts = cell.facts
    n = len(facts)
    per_request = flops_of(cell.work) / max(1, n)
    ttfts, latencies = [f.ttft_s for f in facts], [f.latency_s for f in facts]
    return CellSummary(
        mode=cell.spec.name,
        load=cell.load.label,
        clients=cell.load.clients,
        rate=cell.load.rate,
        requests=n,
        errors=len(cell.errors),
        rejections=cell.rejections,
        first_error=cell.errors[0] if cell.errors else None,
        throughput=n / cell.wall_s if cell.wall_s > 0 else 0.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p95=percentile(ttfts, 95),
        ttft_p99=percentile(ttfts, 99),
        engine_ttft_p50=percentile([f.engine_ttft_s for f in facts], 50),
        latency_p50=percentile(latencies, 50),
        latency_p95=percentile(latencies, 95),
        output_tokens_per_s=sum(f.generated for f in facts) / cell.wall_s
        if cell.wall_s > 0
        else 0.0,
        decode_tokens_per_s=decode_tokens_per_s(facts),
        cpu_s_per_request=cell.cpu_s / max(1, n),
        gflops_per_request=per_request / 1e9,
        work_vs_full=_share(per_request, baselines.get("full")),
        work_vs_prefix=_share(per_request, baselines.get("prefix")),
        background_share=_background_share(cell, flops_of),
        recompute_share=_mean([f.recompute_share for f in facts]),
        escalated_share=_mean([f.escalated for f in facts]),
        repaired_share=_mean([f.repaired for f in facts]),
        skipped_share=_mean([f.skipped_blend for f in facts]),
        computed_now=sum(f.computed_now for f in facts),
        drain_s=cell.drain_s,
        tier_hits=dict(cell.tier_hits),
        kv_bytes=dict(cell.kv_bytes),
        fidelity=fidelity(facts, reference) if reference is not None else None,
        ttfts=ttfts,
        per_request=request_rows(facts, reference),
        served=served_shares(facts),
        reordered_share=_mean([f.reordered for f in facts]) if facts else 0.0,
    )


def decode_tokens_per_s(facts: Sequence[RequestFacts]) -> float:
    """Decode throughput of a cell: the tokens each answer generated after its first (which
    the prefill gives), over the wall time during which at least one request was decoding (the
    union of the spans from each answer's first streamed piece to its last). With batching,
    requests decoding together share that time; without, they overlap on their threads. Other
    requests' prefills run inside those spans either way, so this is the service's decode rate
    under its load, not a step's speed. NaN when no answer had a second token."""
    spans = sorted(f.decoding for f in facts if f.decoding is not None and f.generated > 1)
    covered, end = 0.0, float("-inf")
    for start, stop in spans:
        covered += max(0.0, stop - max(start, end))
        end = max(end, stop)
    tokens = sum(f.generated - 1 for f in facts if f.decoding is not None and f.generated > 1)
    return tokens / covered if covered > 0 else float("nan")


def request_rows(
    facts: Sequence[RequestFacts], reference: dict[int, RequestFacts] | None
) -> list[dict]:
    """Per answered request, in answer order: trace index, chunk ids, client TTFT and latency,
    recompute share, the guard's first-token margin, re-run and repair; with a reference of the same
    chunk order, first-token KL(full || mode), top-1 agreement and whether the answers match."""
    rows = []
    for f in facts:
        row = {
            "index": f.index,
            "chunk_ids": list(f.chunk_ids),
            "ttft_s": f.ttft_s,
            "latency_s": f.latency_s,
            "recompute_share": f.recompute_share,
            "margin": f.margin,
            "escalated": f.escalated,
            "repaired": f.repaired,
            "skipped_blend": f.skipped_blend,
            "served": list(f.served),
            "reordered": f.reordered,
        }
        ref = (reference or {}).get(f.index)
        if ref is not None and ref.chunk_ids == f.chunk_ids:
            row.update(
                first_kl=kl_divergence(ref.first_logits, f.first_logits),
                first_top1=bool(same_top1(ref.first_logits, f.first_logits)),
                same_answer=normalize_answer(ref.text) == normalize_answer(f.text),
            )
        rows.append(row)
    return rows


def fidelity(facts: Sequence[RequestFacts], reference: dict[int, RequestFacts]) -> Fidelity | None:
    """Fidelity of `facts` against the reference requests of the same index and chunk order."""
    return pair_fidelity(
        [
            (reference[f.index], f)
            for f in facts
            if f.index in reference and reference[f.index].chunk_ids == f.chunk_ids
        ]
    )


def pair_fidelity(pairs: Sequence[tuple[RequestFacts, RequestFacts]]) -> Fidelity | None:
    """Fidelity of each pair's second request against its first (None for no pairs)."""
    if not pairs:
        return None
    return Fidelity(
        compared=len(pairs),
        exact_match=statistics.fmean(
            normalize_answer(r.text) == normalize_answer(f.text) for r, f in pairs
        ),
        rouge_l=statistics.fmean(rouge_l(f.text, r.text) for r, f in pairs),
        first_kl=statistics.fmean(kl_divergence(r.first_logits, f.first_logits) for r, f in pairs),
        first_top1=statistics.fmean(same_top1(r.first_logits, f.first_logits) for r, f in pairs),
        **_along_answers(
            [f.answer for _, f in pairs if f.answer is not None and f.answer.positions]
        ),
    )


def _along_answers(forced: list) -> dict[str, float]:
    positions = sum(t.positions for t in forced)
    if not positions:
        return {"answer_top1": float("nan"), "answer_kl": float("nan")}
    return {
        "answer_top1": sum(t.top1_share * t.positions for t in forced) / positions,
        "answer_kl": sum(t.mean_kl * t.positions for t in forced) / positions,
    }


def _background_share(cell: CellResult, flops_of) -> float:
    total = flops_of(cell.work)
    return flops_of(cell.background_work) / total if total > 0 else 0.0


def _share(value: float, baseline: float | None) -> float | None:
    return value / baseline if baseline else None
