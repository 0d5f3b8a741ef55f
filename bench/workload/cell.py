"""One cell of the workload benchmark: one mode spec at one load level, from a fresh snapshot copy.

The cell opens the server's own `Services` on a private copy of the ingested snapshot (base KV
only, empty variant caches), replays the trace, waits for the background work the trace left
(variant builds), and keeps per request only what the summary needs, so memory stays bounded
whatever the trace's length (a prefill result holds the whole prompt's KV).
"""

from __future__ import annotations

import resource
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.fidelity.metrics import TeacherForced, forced_logits, teacher_forced
from bench.workload.corpus import clone_snapshot
from bench.workload.load import Outcome, run_closed_loop, run_open_loop
from bench.workload.modes import ModeSpec
from bench.workload.trace import TraceRequest
from engine.model.work import WorkTotals


@dataclass(frozen=True)
class Load:
    """Closed loop with `clients` clients, or open loop at `rate` requests/s."""

    clients: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"c={self.clients}" if self.clients is not None else f"rate={self.rate:g}/s"


@dataclass
class RequestFacts:
    """What one answered request leaves for the summary (the answer's KV is not kept)."""

    index: int
    chunk_ids: tuple[int, ...]
    text: str
    generated: int
    first_logits: torch.Tensor  # [vocab] float32
    ttft_s: float  # client: submission to first piece
    engine_ttft_s: float  # server: load + prefill stages
    latency_s: float
    recompute_share: float
    computed_now: int  # chunks whose base KV was missing and computed on the request path
    generated_ids: tuple[int, ...] = ()
    escalated: bool = False  # the fidelity guard re-ran the prefill in full (inside TTFT)
    repaired: bool = (
        False  # ... or went on from full prefill while decoding (engine/serving/guard.py)
    )
    margin: float | None = (
        None  # the guard's first-token margin (None: an exact state, not measured)
    )
    # the guard computed it exactly at once, the engine being busy (engine/serving/busy.py)
    skipped_blend: bool = False
    forced: torch.Tensor | None = (
        None  # reference cells: [answer tokens, vocab] logits along its own answer
    )
    answer: TeacherForced | None = (
        None  # this answer's fidelity along the reference's (teacher forcing)
    )
    decoding: tuple[float, float] | None = None  # perf_counter of its first and last streamed piece
    served: tuple[int, int, int] = (
        0,
        0,
        0,
    )  # context tokens served exact, blended, computed (bench/workload/served.py)
    reordered: bool = (
        False  # the order stage moved its chunks off retrieval order (chunk_ids: prompt order)
    )


@dataclass
class CellResult:
    spec: ModeSpec
    load: Load
    facts: list[RequestFacts]
    errors: list[str]
    rejections: int
    wall_s: float  # first submission to the last answer, plus the background drain
    drain_s: float  # background work still running after the last answer
    cpu_s: float  # the whole process: request threads, background builder, torch threads
    work: WorkTotals
    background_work: WorkTotals  # the part of `work` done off the request path (variant builds)
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_misses: dict[str, int] = field(default_factory=dict)
    kv_bytes: dict[str, int] = field(
        default_factory=dict
    )  # after the drain (`Catalog.ready_bytes_by_kind`)


@dataclass(frozen=True)
class Fidelity:
    """How a cell measures answers: keep `forced` logits (the reference cell), or compare with
    `reference` (full's facts by trace index) along its answers. Neither: no teacher forcing."""

    keep_forced: bool = False
    reference: dict[int, RequestFacts] | None = None


def run_cell(
    spec: ModeSpec,
    load: Load,
    trace: Sequence[TraceRequest],
    snapshot: Path,
    run_dir: Path,
    open_services: Callable,
    max_tokens: int,
    max_seconds: float,
    fidelity: Fidelity = Fidelity(),
    keep: bool = False,
) -> CellResult:
    """Replay `trace` for `spec` under `load`; `open_services(data_dir, spec)` starts the services.

    Teacher forcing (`fidelity`) runs on the client thread as each answer arrives, between that
    client's requests: one pass of the answer's tokens, a few percent of a request's compute,
    inside the cell's wall time (the same measuring cost in every mode, `full` included).
    """
    data_dir = clone_snapshot(snapshot, run_dir)
    services = open_services(data_dir, spec)
    try:
        queries = [
            services.rag.query(
                r.question, top_k=r.top_k, mode=spec.mode, max_tokens=max_tokens, temperature=0.0
            )
            for r in trace
        ]
        return _measure(
            services, spec, load, queries, max_seconds, _digest(services.engine, fidelity)
        )
    finally:
        services.close()
        if not keep:
            shutil.rmtree(data_dir, ignore_errors=True)


def _measure(
    services, spec: ModeSpec, load: Load, queries: Sequence, max_seconds: float, digest
) -> CellResult:
    meter = services.engine.runner.meter
    work0, background0 = meter.snapshot(), meter.background_snapshot()
    cpu0, tiers0 = _cpu_seconds(), services.chunk_cache.tier_stats()
    started = time.perf_counter()
    deadline = started + max_seconds
    outcomes = (
        run_closed_loop(services, queries, load.clients, deadline, digest)
        if load.clients is not None
        else run_open_loop(services, queries, load.rate, deadline, digest=digest)
    )
    last_answer = time.perf_counter()
    services.chunk_cache.drain()  # background work this trace caused is charged to it
    ended = time.perf_counter()
    tiers1 = services.chunk_cache.tier_stats()
    return CellResult(
        spec,
        load,
        [o.answer for o in outcomes if o.ok],
        [o.error for o in outcomes if o.error],
        sum(o.rejections for o in outcomes),
        ended - started,
        ended - last_answer,
        _cpu_seconds() - cpu0,
        meter.snapshot() - work0,
        meter.background_snapshot() - background0,
        _delta(tiers0, tiers1, "hits"),
        _delta(tiers0, tiers1, "misses"),
        services.catalog.ready_bytes_by_kind(),
    )


def _digest(engine, fidelity: Fidelity) -> Callable[[Outcome, object], RequestFacts]:
    def digest(outcome: Outcome, answer) -> RequestFacts:
        facts = _facts(outcome, answer)
        ids = facts.generated_ids
        if fidelity.keep_forced and ids:
            facts.forced = forced_logits(engine, answer.result, ids)
            # the reference against itself: top-1 of the prefill's weights along the answer the
            # decode weights gave; 1.0 only where they are the same weights (a rounded `int8` /
            # `int4` decode, `KVMOSAIC_DECODE_WEIGHTS`, puts near-ties the other way)
            top1 = float((facts.forced.argmax(-1) == torch.tensor(ids)).double().mean())
            facts.answer = TeacherForced(len(ids), top1, 0.0)
        ref = (fidelity.reference or {}).get(outcome.index)
        if ref is not None and ref.forced is not None and ref.chunk_ids == facts.chunk_ids:
            facts.answer = teacher_forced(engine, answer.result, ref.generated_ids, ref.forced)
        return facts

    return digest


def _facts(outcome: Outcome, answer) -> RequestFacts:
    result, decoded = answer.result, answer.decoded
    first = outcome.first_piece or outcome.finished
    return RequestFacts(
        outcome.index,
        tuple(r.chunk.id for r in answer.retrieved),
        answer.text,
        len(decoded.token_ids),
        result.logits.detach().float().cpu().clone(),
        first - outcome.submitted,
        answer.stages.get("load", 0.0) + answer.stages.get("prefill", 0.0),
        outcome.finished - outcome.submitted,
        result.recompute_share,
        sum(label.startswith("base (computed") for label in answer.variants),
        decoded.token_ids,
        result.guard.escalated,
        decoded.repaired,
        result.guard.margin,
        skipped_blend=result.guard.skipped_blend,
        decoding=(outcome.first_piece, outcome.last_piece)
        if outcome.first_piece is not None and outcome.last_piece is not None
        else None,
        served=(answer.served.exact, answer.served.blended, answer.served.computed),
        reordered=answer.order is not None and answer.order.reordered,
    )


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _delta(before: dict, after: dict, counter: str) -> dict[str, int]:
    return {tier: after[tier][counter] - before.get(tier, {}).get(counter, 0) for tier in after}
