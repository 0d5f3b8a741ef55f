"""`kvmosaic bench decode-load`: time between a stream's tokens while prefills keep the compute
thread busy, at several `decode_gap_ms` settings in one run.

Each setting: `streams` requests decode through the engine's scheduler (greedy, EOS ignored,
so no answer ends inside the window) while a load thread asks for `prefills` full prefills of
a ~2,200-token prompt back to back. The window runs from the first loaded prefill's request
to the last one's end; every gap between two pieces of a stream inside it counts. Figures are
set beside the same run's unloaded ones: the stream's gap with nothing else computing, and a
full prefill's time alone. `off` sets the gap beyond any prefill, so a prefill runs whole, as
before decode steps could run between its layers.

The streams' KV is a full prefill of the same prompt, computed once and copied per setting;
that prefill and the copies are outside every timed window.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.engine import Engine
from engine.model.decode import SamplingParams
from engine.plan import ChunkInput
from engine.planners import Mode
from engine.result import PrefillResult
from engine.serving.scheduler import DecodeScheduler
from engine.serving.threads import single_threaded

REPO = Path(__file__).resolve().parents[2]
PARTS, WORDS = 6, 180  # the prompt: six parts of docs/architecture.md, ~2,200 tokens in all
OFF_S = 1e9  # a gap no prefill reaches: interleaving off
STREAM_QUESTION = "Copy out Part 0 word for word, then Part 1."
LOAD_QUESTION = "Summarise Part 2 in one sentence."


@dataclass(frozen=True)
class LoadFigures:
    """One setting: the streams' gaps inside the window, each loaded prefill's time, and the
    steps that ran inside computations (`DecodeScheduler.num_interleaved`)."""

    label: str
    gaps_s: tuple[float, ...]
    prefill_s: tuple[float, ...]
    steps_inside: int
    window_s: float
    pieces: int


@dataclass(frozen=True)
class Baseline:
    """The same run's unloaded figures: a stream's gap with nothing else computing, and a full
    prefill's time alone."""

    gap_s: float
    prefill_s: float


def scheduler_of(engine: Engine) -> DecodeScheduler:
    """The engine's decode scheduler; ValueError when it decodes without one (batching off)."""
    if engine.scheduler is None:
        raise ValueError("decode-load measures the decode scheduler: batching must be on")
    return engine.scheduler


def document_chunks(engine: Engine) -> list[ChunkInput]:
    words = (REPO / "docs" / "architecture.md").read_text().split()
    return [
        ChunkInput(
            i + 1, engine.chunk_ids(" ".join(words[i * WORDS : (i + 1) * WORDS]), f"Part {i}")
        )
        for i in range(PARTS)
    ]


def stream_stamps(
    engine: Engine, prefilled: PrefillResult, budget: int, stop: threading.Event
) -> list[float]:
    """Decode a copy of `prefilled` through the scheduler, EOS ignored; the time each piece
    arrives, until `budget` pieces or `stop` is set."""
    cache = prefilled.cache.copy()
    stream = scheduler_of(engine).submit(
        cache, prefilled.logits, SamplingParams(max_new_tokens=budget), eos_ids=()
    )
    stamps = []
    try:
        for _ in stream:
            stamps.append(time.perf_counter())
            if stop.is_set():
                break
    finally:
        stream.close()
    return stamps


def timed_prefill(engine: Engine, chunks: Sequence[ChunkInput], question: str) -> float:
    start = time.perf_counter()
    engine.prefill(chunks, question, Mode.named("full"), max_new_tokens=1)
    return time.perf_counter() - start


def baseline(
    engine: Engine, chunks: Sequence[ChunkInput], prefilled: PrefillResult, pieces: int
) -> Baseline:
    stamps = stream_stamps(engine, prefilled, pieces, threading.Event())
    gap = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    return Baseline(gap, timed_prefill(engine, chunks, LOAD_QUESTION))


def under_load(
    engine: Engine,
    chunks: Sequence[ChunkInput],
    prefilled: PrefillResult,
    label: str,
    gap_s: float,
    streams: int,
    prefills: int,
    budget: int,
) -> LoadFigures:
    """The figures of one setting (see the module docstring)."""
    scheduler = scheduler_of(engine)
    scheduler.decode_gap_s = gap_s
    stop, started = threading.Event(), threading.Barrier(streams + 1)
    stamps: list[list[float]] = [[] for _ in range(streams)]

    def consume(i: int) -> None:
        single_threaded()
        started.wait()
        stamps[i] = stream_stamps(engine, prefilled, budget, stop)

    consumers = [threading.Thread(target=consume, args=(i,)) for i in range(streams)]
    for consumer in consumers:
        consumer.start()
    started.wait()
    time.sleep(0.5)  # the streams are decoding before the load comes
    inside_before = scheduler.num_interleaved
    window_start = time.perf_counter()
    times = [timed_prefill(engine, chunks, LOAD_QUESTION) for _ in range(prefills)]
    window_end = time.perf_counter()
    steps_inside = scheduler.num_interleaved - inside_before
    stop.set()
    for consumer in consumers:
        consumer.join()
    gaps = [
        b - a
        for stream in stamps
        for a, b in zip(stream, stream[1:])
        if window_start <= b <= window_end
    ]
    return LoadFigures(
        label,
        tuple(gaps),
        tuple(times),
        steps_inside,
        window_end - window_start,
        len(gaps),
    )


def run_decode_load(
    engine: Engine,
    gaps_ms: Sequence[float | None],
    streams: int = 1,
    prefills: int = 3,
    budget: int = 2048,
) -> tuple[Baseline, list[LoadFigures]]:
    """Every setting of `gaps_ms` (None: off) under the same load, and the unloaded baseline;
    the scheduler's own gap is put back afterwards."""
    scheduler = scheduler_of(engine)
    own_gap = scheduler.decode_gap_s
    chunks = document_chunks(engine)
    prefilled = engine.prefill(chunks, STREAM_QUESTION, Mode.named("full"), max_new_tokens=budget)
    timed_prefill(engine, chunks, LOAD_QUESTION)  # warm-up, not counted
    base = baseline(engine, chunks, prefilled, 64)
    figures = []
    try:
        for gap in gaps_ms:
            label = "off" if gap is None else f"{gap:g} ms"
            gap_s = OFF_S if gap is None else gap / 1000
            figures.append(
                under_load(engine, chunks, prefilled, label, gap_s, streams, prefills, budget)
            )
            print(format_row(figures[-1], base), flush=True)
    finally:
        scheduler.decode_gap_s = own_gap
    return base, figures


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


HEADER = (
    "| decode_gap_ms | pieces | gap p50 ms | gap p95 ms | gap max ms | ms per piece "
    "| × unloaded | prefill s | × alone | steps inside |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(figures: LoadFigures, base: Baseline) -> str:
    gaps = figures.gaps_s or (float("nan"),)
    per_piece = figures.window_s / figures.pieces if figures.pieces else float("nan")
    prefill = statistics.median(figures.prefill_s)
    return (
        f"| {figures.label} | {figures.pieces} | {1000 * statistics.median(gaps):.1f} "
        f"| {1000 * percentile(gaps, 0.95):.1f} | {1000 * max(gaps):.1f} | {1000 * per_piece:.1f} "
        f"| {per_piece / base.gap_s:.2f} | {prefill:.2f} | {prefill / base.prefill_s:.2f} "
        f"| {figures.steps_inside} |"
    )


def format_report(base: Baseline, figures: Sequence[LoadFigures]) -> str:
    lines = [
        f"unloaded: gap {1000 * base.gap_s:.1f} ms per piece, full prefill {base.prefill_s:.2f} s",
        HEADER,
        *(format_row(f, base) for f in figures),
    ]
    return "\n".join(lines)
