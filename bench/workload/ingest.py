"""`kvmosaic bench ingest`: how fast ingest turns passages into stored base KV, against the
same passages one chunk per pass and against the engine's own full-prefill rate, in one run.

Each setting ingests the whole corpus (the workload bench's: a benchmark JSON's records, one
document per distinct passage) through the server's real ingest path (`Ingestor.ingest`:
chunk, embed, index, encode base KV, store it in the tiers) into a fresh data dir, with
`KVMOSAIC_INGEST_KV=eager`. Each run names its rows per pass and its `encode_dtype`:
`batch_tokens` 1 encodes every chunk in a pass of its own (how ingest worked before packed
batches); larger values pack a document's chunks into passes of up to that many rows;
`engine` computes base KV in the engine's own dtype, `auto` in bfloat16 on CPUs with
AMX-BF16 (engine/model/encode_dtype.py). The prefill row is the engine's full prefill of one prompt
of
about
`prompt_tokens` tokens made of the corpus's first chunks (median of `prefill_repeats`): the
rate a request pays to compute KV, which ingest should at least match.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from bench.workload.corpus import Corpus
from engine.config import Fidelity
from engine.planners import reference_mode


@dataclass(frozen=True)
class IngestOptions:
    work_dir: Path
    runs: tuple[tuple[int, str], ...] = (
        (1, "engine"),
        (2048, "engine"),
        (2048, "auto"),
    )  # (batch_tokens, encode_dtype)
    prompt_tokens: int = 3800
    prefill_repeats: int = 3
    progress: bool = True


@dataclass(frozen=True)
class IngestRow:
    """One way of computing KV: `tokens` chunk tokens in `seconds` (ingest rows: model,
    embedding, indexing and storing included)."""

    label: str
    tokens: int
    chunks: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def run_ingest_bench(
    corpus: Corpus,
    options: IngestOptions,
    open_services: Callable[[Path, dict], object],
    say: Callable[[str], None] = print,
) -> list[IngestRow]:
    """Ingest rows (one per run) then the full-prefill row.

    `open_services(data_dir, overrides)` starts the server's services with those settings.
    """
    if not corpus.documents:
        raise ValueError("the corpus has no documents")
    rows = [
        _ingest(corpus, batch, dtype, options, open_services, say) for batch, dtype in options.runs
    ]
    rows.append(_full_prefill(corpus, options, open_services, say))
    return rows


def _ingest(
    corpus: Corpus, batch: int, encode_dtype: str, options: IngestOptions, open_services, say
) -> IngestRow:
    from engine.model.encode_dtype import resolve_encode_dtype

    data_dir = options.work_dir / f"ingest-{batch}-{encode_dtype}"
    shutil.rmtree(data_dir, ignore_errors=True)
    services = open_services(
        data_dir, {"ingest_batch_tokens": batch, "ingest_kv": "eager", "encode_dtype": encode_dtype}
    )
    tokens = chunks = 0
    try:
        engine = services.engine
        dtype = str(resolve_encode_dtype(engine.config.encode_dtype, engine.loaded)).removeprefix(
            "torch."
        )
        started = time.perf_counter()
        bar = tqdm(
            corpus.documents,
            unit="doc",
            desc=f"ingest, {batch} rows per pass",
            disable=not options.progress,
        )
        for doc in bar:
            result = services.ingestor.ingest(doc)
            tokens += result.num_tokens
            chunks += result.document.num_chunks if result.created else 0
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - started):.0f} tok/s")
        seconds = time.perf_counter() - started
    finally:
        services.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    label = (
        "ingest, one chunk per pass" if batch == 1 else f"ingest, packed ({batch} rows/pass)"
    ) + f", {dtype}"
    say(f"  {label}: {tokens} tokens, {chunks} chunks in {seconds:.1f} s")
    return IngestRow(label, tokens, chunks, seconds)


def _full_prefill(corpus: Corpus, options: IngestOptions, open_services, say) -> IngestRow:
    from engine.plan import ChunkInput

    data_dir = options.work_dir / "prefill"
    shutil.rmtree(data_dir, ignore_errors=True)
    services = open_services(data_dir, {})
    try:
        engine, chunker = services.engine, services.ingestor.chunker
        inputs: list[ChunkInput] = []
        total = 0
        for doc in corpus.documents:
            for piece in chunker.split(doc.text):
                if total >= options.prompt_tokens:
                    break
                ids = engine.chunk_ids(piece.text, doc.title)
                inputs.append(ChunkInput(len(inputs), ids))
                total += len(ids)
        question = corpus.questions[0] if corpus.questions else "What are these passages about?"
        times, tokens = [], 0
        for _ in range(options.prefill_repeats + 1):  # the first run warms up and is not counted
            started = time.perf_counter()
            result = engine.prefill(
                inputs, question, reference_mode(), Fidelity.EXACT, max_new_tokens=1
            )
            times.append(time.perf_counter() - started)
            tokens = result.layout.total_len
    finally:
        services.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    seconds = statistics.median(times[1:])
    say(
        f"  engine full prefill: {tokens} tokens in {seconds:.2f} s (median of "
        f"{options.prefill_repeats})"
    )
    return IngestRow("engine full prefill, one prompt", tokens, len(inputs), seconds)


def format_ingest_table(rows: list[IngestRow]) -> str:
    """Rates as ratios against the first row (one chunk per pass) and the last (full prefill)."""
    first, prefill = rows[0], rows[-1]
    lines = [
        f"{'':42} {'tokens':>7} {'chunks':>6} {'seconds':>8} {'tok/s':>7} {'vs first':>8} "
        f"{'vs prefill':>10}"
    ]
    for row in rows:
        lines.append(
            f"{row.label:42} {row.tokens:>7} {row.chunks:>6} {row.seconds:>8.1f} "
            f"{row.tokens_per_s:>7.0f} "
            f"{row.tokens_per_s / first.tokens_per_s:>7.2f}x "
            f"{row.tokens_per_s / prefill.tokens_per_s:>9.2f}x"
        )
    return "\n".join(lines)
