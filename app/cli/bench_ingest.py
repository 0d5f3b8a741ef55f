"""`kvmosaic bench ingest`: ingest tokens/s, packed against one chunk per pass and against the
engine's full prefill, on the workload bench's corpus (see `app/bench/ingest.py`)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from app.cli.bench_workload import DEFAULT_CORPUS


def add_ingest_parser(kinds, add_engine_arguments) -> None:
    p = kinds.add_parser("ingest", help="ingest tokens/s: packed vs one chunk per pass vs the engine's full prefill",
                         description=__doc__)
    add_engine_arguments(p)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                   help="a directory of .txt/.md files or a benchmark JSON (default: MuSiQue in ../shared)")
    p.add_argument("--start", type=int, default=100, help="benchmark JSON: first record (default 100)")
    p.add_argument("--records", type=int, default=12, help="benchmark JSON: records pooled (default 12)")
    p.add_argument("--batch-tokens", default=None,
                   help="rows per encoding pass to compare, comma-separated (default 1 and KVMOSAIC_INGEST_BATCH_TOKENS)")
    p.add_argument("--prompt-tokens", type=int, default=3800, help="full-prefill prompt length (default 3800)")
    p.add_argument("--tiers", default="disk", help="KV store tiers ingest writes to (default disk)")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch data dirs (default <data-dir>/bench-ingest)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.set_defaults(handler=run_ingest_command)


def run_ingest_command(args) -> int:
    from app.bench.corpus import load_corpus
    from app.bench.ingest import IngestOptions, format_ingest_table, run_ingest_bench
    from app.bench.workload import Server
    from app.cli.bench import settings_overrides
    from app.settings import Settings
    from engine.engine import Engine
    from engine.errors import InvalidRequest
    from retrieval.embedder import Embedder

    values = settings_overrides(args)
    base = Settings(**values)
    batches = _batch_tokens(args.batch_tokens, base.ingest_batch_tokens)
    corpus = load_corpus(args.corpus, args.start, args.records)
    options = IngestOptions(work_dir=args.work_dir or base.data_dir / "bench-ingest", batch_tokens=batches,
                            prompt_tokens=args.prompt_tokens, progress=sys.stderr.isatty())
    if options.prompt_tokens < 1:
        raise InvalidRequest("--prompt-tokens must be at least 1")
    values.update(database_url="", store_tiers=args.tiers)
    engine = Engine.load(base.engine_config())
    embedder = Embedder(base.embedder_path)

    def open_services(data_dir: Path, overrides: dict):
        return Server(engine.loaded, embedder, {**values, **overrides}).open(data_dir)

    print(f"corpus {corpus.name}: {len(corpus.documents)} documents", flush=True)
    rows = run_ingest_bench(corpus, options, open_services, say=lambda line: print(line, flush=True))
    print(format_ingest_table(rows))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in rows], indent=2))
        print(f"wrote {args.json}")
    return 0


def _batch_tokens(text: str | None, configured: int) -> tuple[int, ...]:
    from engine.errors import InvalidRequest

    if text is None:
        return (1, configured) if configured != 1 else (1,)
    try:
        batches = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise InvalidRequest(f"--batch-tokens: expected integers like 1,2048, got {text!r}") from None
    if not batches or min(batches) < 1:
        raise InvalidRequest("--batch-tokens: every value must be at least 1")
    return batches
