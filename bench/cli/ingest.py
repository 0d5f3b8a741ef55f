"""`kvmosaic bench ingest`: ingest tokens/s, packed against one chunk per pass and against the
engine's full prefill, on the workload bench's corpus (see `bench/workload/ingest.py`)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

from bench.cli.workload import add_corpus_arguments


def add_ingest_parser(kinds, add_engine_arguments) -> None:
    p = kinds.add_parser(
        "ingest",
        help="ingest tokens/s: packed vs one chunk per pass vs the engine's full prefill",
        description=__doc__,
    )
    add_engine_arguments(p)
    add_corpus_arguments(p)
    p.add_argument(
        "--runs",
        default=None,
        help="ingest runs as ROWS_PER_PASS:ENCODE_DTYPE, comma-separated (default 1:engine, then "
        "KVMOSAIC_INGEST_BATCH_TOKENS with engine and with KVMOSAIC_ENCODE_DTYPE)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=3800, help="full-prefill prompt length (default 3800)"
    )
    p.add_argument("--tiers", default="disk", help="KV store tiers ingest writes to (default disk)")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="scratch data dirs (default <data-dir>/bench-ingest)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.set_defaults(handler=run_ingest_command)


def run_ingest_command(args) -> int:
    from app.cli.common import settings_overrides
    from app.settings import Settings
    from bench.workload.corpus import load_corpus
    from bench.workload.ingest import IngestOptions, format_ingest_table, run_ingest_bench
    from bench.workload.workload import Server
    from engine.engine import Engine
    from engine.errors import InvalidRequest
    from engine.serving.threads import in_own_thread
    from retrieval.embedder import Embedder

    values = settings_overrides(args)
    base = Settings(**values)
    runs = _runs(args.runs, base.ingest_batch_tokens, base.encode_dtype)
    corpus = load_corpus(args.corpus, args.start, args.records)
    options = IngestOptions(
        work_dir=args.work_dir or base.data_dir / "bench-ingest",
        runs=runs,
        prompt_tokens=args.prompt_tokens,
        progress=sys.stderr.isatty(),
    )
    if options.prompt_tokens < 1:
        raise InvalidRequest("--prompt-tokens must be at least 1")
    values.update(database_url="", store_tiers=args.tiers)
    engine = Engine.load(base.engine_config())
    embedder = in_own_thread(
        partial(Embedder, base.embedder_path, linear_kernel=base.linear_kernel)
    )

    def open_services(data_dir: Path, overrides: dict):
        return Server(engine.loaded, embedder, {**values, **overrides}).open(data_dir)

    print(f"corpus {corpus.name}: {len(corpus.documents)} documents", flush=True)
    rows = run_ingest_bench(
        corpus, options, open_services, say=lambda line: print(line, flush=True)
    )
    print(format_ingest_table(rows))
    if args.json:
        args.json.write_text(
            json.dumps([{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in rows], indent=2)
        )
        print(f"wrote {args.json}")
    return 0


def _runs(text: str | None, batch_tokens: int, encode_dtype: str) -> tuple[tuple[int, str], ...]:
    """(rows per pass, encode dtype) of each ingest run; InvalidRequest for a bad --runs."""
    from engine.config import ENCODE_DTYPES
    from engine.errors import InvalidRequest

    if text is None:
        runs = [(1, "engine"), (batch_tokens, "engine")] + (
            [(batch_tokens, encode_dtype)] if encode_dtype != "engine" else []
        )
        return tuple(dict.fromkeys(runs))
    parsed = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        rows, _, dtype = item.partition(":")
        dtype = dtype or "engine"
        if not rows.isdigit() or int(rows) < 1 or dtype not in ENCODE_DTYPES:
            raise InvalidRequest(
                f"--runs: expected ROWS:DTYPE like 1:engine,2048:auto (dtype one of "
                f"{', '.join(ENCODE_DTYPES)}), got {item!r}"
            )
        parsed.append((int(rows), dtype))
    if not parsed:
        raise InvalidRequest("--runs: name at least one run")
    return tuple(parsed)
