"""The workload's stability floor and task accuracy: what `full` itself does, and whether answers
are right.

Floor: after the cells, off the clock, one extra full prefill per distinct request of the
reference cell, its retrieved chunks in a seeded other order, decoded greedily like the
cell's requests and measured against the reference cell's answer to the same request exactly
as a mode is (`summary.Fidelity`: identical answers, ROUGE-L, first-token KL and top-1,
teacher-forced top-1 / KL along full's answer). A mode whose deviation is inside the floor
deviates no more than full prefill does when the retriever returns the same chunks in another
order, which is an arbitrary choice (docs/benchmarks/fidelity.md).

Accuracy: where the corpus carries gold answers (a benchmark JSON, e.g. generated cases from
`bench.fidelity.cases`), each answered request is scored against the gold answers of the
question it asks (a reformulation keeps its question's answers), with a bootstrap interval
over requests and the paired difference against `full` on the same requests.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.fidelity.accuracy import Interval, bootstrap, paired_difference, score_answer
from bench.fidelity.metrics import teacher_forced
from bench.workload.cell import RequestFacts
from bench.workload.summary import Fidelity, pair_fidelity
from bench.workload.trace import TraceRequest
from engine.config import Fidelity as GuardLevel
from engine.decoding import read_out
from engine.model.decode import SamplingParams
from engine.planners import reference_mode


@dataclass(frozen=True)
class CellAccuracy:
    """Gold containment of one cell's answers and, paired on the same requests, against full's."""

    scored: int
    accuracy: Interval
    versus_full: Interval | None


def measure_floor(
    services,
    trace: Sequence[TraceRequest],
    reference: dict[int, RequestFacts],
    max_tokens: int,
    seed: int = 0,
) -> Fidelity | None:
    """Full prefill of each distinct reference request (first of each chunk list) in another
    chunk order, against the reference's answer; None when no request has two chunks."""
    from app.retrieve import retrieve_chunks

    engine, top_k = services.engine, services.settings.default_top_k
    rng = random.Random(seed)
    pairs: list[tuple[RequestFacts, RequestFacts]] = []
    seen: set[tuple[int, ...]] = set()
    for index in sorted(reference):
        ref = reference[index]
        if ref.chunk_ids in seen or len(ref.chunk_ids) < 2:
            continue
        seen.add(ref.chunk_ids)
        request = trace[index]
        hits = retrieve_chunks(
            services.retriever, services.catalog, engine, request.question, request.top_k or top_k
        )
        if tuple(h.chunk.id for h in hits) != ref.chunk_ids:
            continue  # the index answered differently: not the same request
        chunks = services.chunk_cache.load(hits, reference_mode()).inputs
        pairs.append((ref, _reordered_full(engine, chunks, request.question, ref, max_tokens, rng)))
    return pair_fidelity(pairs)


def _reordered_full(
    engine, chunks, question: str, ref: RequestFacts, max_tokens: int, rng: random.Random
) -> RequestFacts:
    order = list(range(len(chunks)))
    while order == sorted(order):
        rng.shuffle(order)
    result = engine.prefill(
        [chunks[i] for i in order],
        question,
        reference_mode(),
        GuardLevel.EXACT,
        max_new_tokens=max_tokens,
    )
    logits = result.logits.detach().float().cpu().clone()
    text, decoded = read_out(engine.generate(result, SamplingParams(max_new_tokens=max_tokens)))
    text = text.strip()
    answer = (
        teacher_forced(engine, result, ref.generated_ids, ref.forced)
        if ref.forced is not None
        else None
    )
    return RequestFacts(
        ref.index,
        tuple(chunks[i].chunk_id for i in order),
        text,
        len(decoded.token_ids),
        logits,
        0.0,
        0.0,
        0.0,
        1.0,
        0,
        decoded.token_ids,
        answer=answer,
    )


def floor_pass(
    open_services,
    snapshot: Path,
    scratch: Path,
    trace: Sequence[TraceRequest],
    reference: dict[int, RequestFacts],
    max_tokens: int,
    seed: int = 0,
) -> Fidelity | None:
    """`measure_floor` on a private clone of the snapshot (`open_services(data_dir)` opens a
    `full` server on it), removed afterwards."""
    from bench.workload.corpus import clone_snapshot

    services = open_services(clone_snapshot(snapshot, scratch))
    try:
        return measure_floor(services, trace, reference, max_tokens, seed)
    finally:
        services.close()
        shutil.rmtree(scratch, ignore_errors=True)


def cell_accuracy(
    facts: Sequence[RequestFacts],
    trace: Sequence[TraceRequest],
    answers: Sequence[Sequence[str]],
    reference: Sequence[RequestFacts] | None,
) -> CellAccuracy | None:
    """Scores of a cell's answers against the gold answers of each request's question
    (`answers[need]`); None when the trace's requests name no question with gold answers."""
    scores = _scores(facts, trace, answers)
    if not scores:
        return None
    theirs = _scores(reference, trace, answers) if reference is not None else {}
    shared = sorted(set(scores) & set(theirs))
    versus = (
        paired_difference([scores[i] for i in shared], [theirs[i] for i in shared])
        if shared
        else None
    )
    return CellAccuracy(len(scores), bootstrap(list(scores.values())), versus)


def _scores(
    facts: Sequence[RequestFacts], trace: Sequence[TraceRequest], answers: Sequence[Sequence[str]]
) -> dict[int, float]:
    out: dict[int, float] = {}
    for f in facts:
        need = trace[f.index].need
        if need is None or need >= len(answers) or not answers[need]:
            continue
        out[f.index] = score_answer(f.text, answers[need]).contains
    return out
