"""The workload benchmark: a trace of questions through the server's own request path.

Path: the trace's questions go through `Services` exactly as the HTTP server builds it (the
work queue's worker threads and 503 rule, `RagService.ask`: retrieve → catalog → store →
engine → decode → variant storage) in this process, without HTTP: the HTTP layer adds the
same small cost to every mode, and staying in process lets the benchmark read each answer's
first-token logits for fidelity. Each (mode, load) cell starts from the same ingested
snapshot with base KV only, so the warm-up of variant caches is paid inside the trace.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.workload.cell import CellResult, Fidelity, Load, run_cell
from bench.workload.corpus import (
    Corpus,
    Snapshot,
    build_snapshot,
    clone_snapshot,
    load_corpus,
    snapshot_key,
)
from bench.workload.floor import CellAccuracy, cell_accuracy, floor_pass
from bench.workload.modes import ModeSpec
from bench.workload.served import OracleWork, oracle_work
from bench.workload.summary import CellSummary, summarize
from bench.workload.summary import Fidelity as AnswerFidelity
from bench.workload.trace import (
    TraceRequest,
    TraceStats,
    distinct_trace,
    generate_trace,
    read_trace,
    trace_stats,
)
from engine.errors import InvalidRequest

log = logging.getLogger(__name__)

REFERENCE = "full"
BASELINES = ("full", "prefix")


@dataclass(frozen=True)
class WorkloadOptions:
    """Everything a run depends on (the CLI's flags; docs/benchmarks/README.md)."""

    corpus: Path
    modes: tuple[ModeSpec, ...]
    work_dir: Path
    start: int = 100
    records: int | None = 12
    trace: Path | None = None
    requests: int = 32
    seed: int = 0
    zipf_s: float = 1.2
    reformulate: float = 0.8
    distinct: bool = False  # generated trace: each question once, in a seeded order (no repeats)
    concurrency: tuple[int, ...] = (1, 4)
    rate: float | None = None
    max_tokens: int = 32
    max_seconds: float = 900.0
    answer_fidelity: bool = True  # teacher forcing along full's answers (see cell.run_cell)
    # after the cells, full in another chunk order per distinct request (bench/workload/floor.py)
    floor: bool = True
    keep: bool = False
    progress: bool = True

    def loads(self) -> list[Load]:
        return (
            [Load(rate=self.rate)]
            if self.rate is not None
            else [Load(clients=c) for c in self.concurrency]
        )


@dataclass
class WorkloadRun:
    """A finished run: what it ran on, the trace and its reuse, and one summary per cell."""

    options: WorkloadOptions
    corpus: str
    snapshot: Snapshot
    trace: list[TraceRequest]
    stats: TraceStats
    summaries: list[CellSummary]
    environment: dict = field(default_factory=dict)
    seconds: float = 0.0
    oracle: OracleWork | None = None  # the trace's limit: every chunk seen before reused exactly
    floor: AnswerFidelity | None = (
        None  # full prefill in another chunk order against full (bench/workload/floor.py)
    )
    accuracy: dict[str, CellAccuracy] = field(
        default_factory=dict
    )  # by cell label, where gold answers exist


class Server:
    """Opens the server's services on a data dir, for one mode spec (its settings on top)."""

    def __init__(self, loaded, embedder, settings_values: dict):
        self.loaded = loaded
        self.embedder = embedder
        self.values = settings_values

    def settings(self, data_dir: Path, spec: ModeSpec | None = None):
        from app.settings import Settings

        values = {**self.values, **(spec.overrides() if spec else {}), "data_dir": data_dir}
        try:
            return Settings(**values)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise InvalidRequest(f"mode {spec.name if spec else ''}: {exc}") from None

    def open(self, data_dir: Path, spec: ModeSpec | None = None):
        from app.services import Services
        from engine.engine import Engine

        settings = self.settings(data_dir, spec)
        return Services.start(
            settings, engine=Engine(settings.engine_config(), self.loaded), embedder=self.embedder
        )


def run_workload(
    options: WorkloadOptions, server: Server, say: Callable[[str], None] = print
) -> WorkloadRun:
    started = time.perf_counter()
    corpus = load_corpus(options.corpus, options.start, options.records)
    trace = _trace(options, corpus)
    snapshot = _snapshot(options, corpus, server, say)
    retrieved, oracle = _retrieve_all(
        server, snapshot, trace, options.work_dir / "runs" / "retrieval"
    )
    stats = trace_stats(trace, retrieved)
    say(
        f"trace: {stats.requests} requests, {stats.seen_before:.0%} of retrieved chunks seen "
        "before; "
        f"chunk lists repeated in order {stats.same_order:.0%}, in another order "
        f"{stats.other_order:.0%}, "
        f"partly {stats.partly:.0%}, not at all {stats.fresh:.0%}"
    )
    say(oracle.line())
    cells = _run_cells(options, server, snapshot, trace, say)
    floor = _floor(options, server, snapshot, trace, cells, say)
    run = WorkloadRun(
        options,
        corpus.name,
        snapshot,
        trace,
        stats,
        _summaries(cells, server),
        _environment(server),
        time.perf_counter() - started,
        oracle,
        floor,
        _accuracy(cells, trace, corpus),
    )
    return run


def _floor(
    options: WorkloadOptions,
    server: Server,
    snapshot: Snapshot,
    trace: list[TraceRequest],
    cells: list[CellResult],
    say,
) -> AnswerFidelity | None:
    """The stability floor, off the clock: full in another chunk order against the reference
    cell."""
    reference = next((c for c in cells if c.spec.name == REFERENCE), None)
    if reference is None or not options.floor:
        return None
    facts = {f.index: f for f in reference.facts}
    floor = floor_pass(
        server.open,
        snapshot.path,
        options.work_dir / "runs" / "floor",
        trace,
        facts,
        options.max_tokens,
        options.seed,
    )
    if floor is not None:
        say(
            f"floor (full in another chunk order, {floor.compared} distinct requests, off the "
            "clock): "
            f"same answer {floor.exact_match:.2f}, ROUGE-L {floor.rouge_l:.3f}, first-token KL "
            f"{floor.first_kl:.4f}"
        )
    return floor


def _accuracy(
    cells: list[CellResult], trace: list[TraceRequest], corpus: Corpus
) -> dict[str, CellAccuracy]:
    """Per cell label (`mode @ load`), gold containment where the corpus has answers."""
    out: dict[str, CellAccuracy] = {}
    for cell in cells:
        reference = next(
            (c.facts for c in cells if c.spec.name == REFERENCE and c.load == cell.load), None
        )
        scored = cell_accuracy(cell.facts, trace, corpus.answers, reference)
        if scored is not None:
            out[f"{cell.spec.name} @ {cell.load.label}"] = scored
    return out


def _trace(options: WorkloadOptions, corpus: Corpus) -> list[TraceRequest]:
    if options.trace is not None:
        return read_trace(options.trace)
    if not corpus.questions:
        raise InvalidRequest(
            f"{options.corpus}: a directory corpus has no questions; pass --trace FILE"
        )
    if options.distinct:
        return distinct_trace(corpus.questions, options.requests, options.seed)
    return generate_trace(
        corpus.questions, options.requests, options.seed, options.zipf_s, options.reformulate
    )


def _snapshot(options: WorkloadOptions, corpus: Corpus, server: Server, say) -> Snapshot:
    key = snapshot_key(corpus, server.settings(options.work_dir), server.loaded.fingerprint)
    snapshot = build_snapshot(
        corpus, options.work_dir / "snapshots" / key, server.open, options.progress
    )
    how = "reused from an earlier run; its" if snapshot.reused else "built now;"
    say(
        f"corpus {corpus.name}: {snapshot.documents} documents, {snapshot.chunks} chunks, "
        f"{snapshot.tokens} tokens, "
        f"{snapshot.kv_bytes / 2**20:.0f} MiB of base KV; ingest {how} "
        f"{snapshot.ingest_seconds:.0f} s "
        f"({snapshot.tokens / max(snapshot.ingest_seconds, 1e-9):.0f} tokens/s)"
    )
    return snapshot


def _retrieve_all(
    server: Server, snapshot: Snapshot, trace: list[TraceRequest], scratch: Path
) -> tuple[list[list[int]], OracleWork]:
    """The chunk ids each request retrieves (the same in every cell: one index, one embedder),
    and the trace's oracle work (`bench/workload/served.py`)."""
    from app.retrieve import retrieve_chunks

    services = server.open(clone_snapshot(snapshot.path, scratch))
    try:
        top_k = services.settings.default_top_k
        hits = [
            retrieve_chunks(
                services.retriever, services.catalog, services.engine, t.question, t.top_k or top_k
            )
            for t in trace
        ]
        tokens = {r.chunk.id: len(r.token_ids) for rs in hits for r in rs}
        questions = [len(services.engine.prompts.question_ids(t.question)) for t in trace]
        retrieved = [[r.chunk.id for r in rs] for rs in hits]
        return retrieved, oracle_work(retrieved, tokens, questions)
    finally:
        services.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _run_cells(
    options: WorkloadOptions, server: Server, snapshot: Snapshot, trace, say
) -> list[CellResult]:
    specs = list(options.modes)
    if not any(s.name == REFERENCE for s in specs):
        say(f"adding `{REFERENCE}`: fidelity is measured against it")
        specs.insert(0, ModeSpec(REFERENCE))
    specs.sort(
        key=lambda s: s.name != REFERENCE
    )  # the reference first, the rest in the given order
    cells: list[CellResult] = []
    reference = None
    for load in options.loads():
        for spec in specs:
            run_dir = options.work_dir / "runs" / f"{_slug(spec.name)}-{_slug(load.label)}"
            fidelity = Fidelity(
                keep_forced=reference is None and spec.name == REFERENCE, reference=reference
            )
            if not options.answer_fidelity:
                fidelity = Fidelity()
            cell = run_cell(
                spec,
                load,
                trace,
                snapshot.path,
                run_dir,
                server.open,
                options.max_tokens,
                options.max_seconds,
                fidelity,
                options.keep,
            )
            if fidelity.keep_forced:
                reference = {f.index: f for f in cell.facts}
            say(
                f"  {spec.name:<44} {load.label:<10} {len(cell.facts)} answered in "
                f"{cell.wall_s:.1f} s"
                + (f", {len(cell.errors)} errors (first: {cell.errors[0]})" if cell.errors else "")
            )
            cells.append(cell)
    return cells


def _summaries(cells: list[CellResult], server: Server) -> list[CellSummary]:
    from bench.fidelity.flops import FlopCounter

    counter = FlopCounter(
        server.loaded.model, server.loaded.spec.num_heads, server.loaded.spec.head_dim
    )
    reference = next(
        ({f.index: f for f in c.facts} for c in cells if c.spec.name == REFERENCE), None
    )
    out = []
    for cell in cells:
        baselines = {
            c.spec.name: counter.of_work(c.work) / max(1, len(c.facts))
            for c in cells
            if c.load == cell.load and c.spec.name in BASELINES
        }
        out.append(summarize(cell, counter.of_work, reference, baselines))
    return out


def _environment(server: Server) -> dict:
    values = server.values
    return {
        "model": server.loaded.fingerprint,
        "device": str(server.loaded.device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "workers": values.get("workers"),
        "queue_size": values.get("queue_size"),
        "tiers": values.get("store_tiers"),
    }


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)[:60]
