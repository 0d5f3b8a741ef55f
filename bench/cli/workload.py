"""`kvmosaic bench workload`: a trace of questions through the server's request path, per mode and
load."""

from __future__ import annotations

import shlex
import sys
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "cacheblend" / "musique_s.json"
DEFAULT_MODES = "full,prefix-apc,prefix,cacheblend-paper,cacheblend,cachecraft"
# --quick: a few minutes on a 2-core machine, for a first look (docs/benchmarks/README.md)
QUICK = dict(records=3, requests=12, modes="full,cacheblend,cachecraft", max_tokens=8)


def add_workload_parser(kinds, add_engine_arguments) -> None:
    p = kinds.add_parser(
        "workload",
        help="a RAG trace through the server: throughput, TTFT, work, fidelity",
        description=__doc__,
    )
    add_engine_arguments(p)
    add_corpus_arguments(p)
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="JSON lines {question, top_k?} (default: generated)",
    )
    p.add_argument(
        "--requests", type=int, default=32, help="generated trace: requests (default 32)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="generated trace and open-loop arrivals: seed"
    )
    # defaults: the share of retrieved chunks seen before is near Cache-Craft's production figure
    p.add_argument(
        "--zipf", type=float, default=1.2, help="generated trace: Zipf exponent of popularity (1.2)"
    )
    p.add_argument(
        "--reformulate",
        type=float,
        default=0.8,
        help="generated trace: chance that a repeated question is reworded (default 0.8)",
    )
    p.add_argument(
        "--distinct",
        action="store_true",
        help="generated trace: each question once, in a seeded order (no repeats; needs "
        "--records with at least --requests questions)",
    )
    p.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help="mode specs, e.g. full,cacheblend:selection=deviation,check_layers=1 "
        f"(presets cacheblend-paper, prefix-apc; default {DEFAULT_MODES})",
    )
    p.add_argument(
        "--concurrency", default="1,4", help="closed-loop clients, comma-separated (default 1,4)"
    )
    p.add_argument(
        "--rate", type=float, default=None, help="open loop: Poisson arrivals per second instead"
    )
    p.add_argument(
        "--max-tokens", type=int, default=32, help="answer tokens per request (greedy; default 32)"
    )
    p.add_argument(
        "--max-seconds", type=float, default=900, help="per mode and load: stop sending after this"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="server worker threads (default KVMOSAIC_WORKERS)"
    )
    p.add_argument(
        "--queue-size", type=int, default=None, help="server queue (default KVMOSAIC_QUEUE_SIZE)"
    )
    p.add_argument(
        "--tiers", default="cpu,disk", help="KV store tiers of every run (default cpu,disk)"
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="snapshots and runs (default <data-dir>/bench-workload)",
    )
    p.add_argument("--keep", action="store_true", help="keep each run's data dir")
    p.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the stability floor (full in another chunk order per distinct request, off the "
        "clock)",
    )
    p.add_argument(
        "--no-answer-fidelity",
        dest="answer_fidelity",
        action="store_false",
        help="skip teacher forcing along full's answers (answer-position top-1 and KL)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="about 3 minutes: 3 records, 12 requests, 8 tokens, modes full,cacheblend,cachecraft",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        help="write README.md, results.json, trace and plots here",
    )
    p.set_defaults(handler=run_workload_command)


def add_corpus_arguments(p) -> None:
    """The corpus a benchmark ingests (the workload bench's and `bench ingest`'s)."""
    p.add_argument(
        "--corpus",
        type=Path,
        default=DEFAULT_CORPUS,
        help="a directory of .txt/.md files or a benchmark JSON (default: MuSiQue in ../shared)",
    )
    p.add_argument(
        "--start", type=int, default=100, help="benchmark JSON: first record (default 100)"
    )
    p.add_argument(
        "--records", type=int, default=12, help="benchmark JSON: records pooled (default 12)"
    )


def workload_options(args, data_dir: Path):
    from bench.workload.modes import parse_modes
    from bench.workload.workload import WorkloadOptions
    from engine.errors import InvalidRequest

    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == _default(key):  # explicit flags win over --quick
                setattr(args, key, value)
    try:
        concurrency = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    except ValueError:
        raise InvalidRequest(
            f"--concurrency: expected integers like 1,4, got {args.concurrency!r}"
        ) from None
    if not concurrency or min(concurrency) < 1:
        raise InvalidRequest("--concurrency: every level must be at least 1")
    if args.rate is not None and args.rate <= 0:
        raise InvalidRequest("--rate must be positive")
    return WorkloadOptions(
        corpus=args.corpus,
        modes=tuple(parse_modes(args.modes)),
        work_dir=args.work_dir or data_dir / "bench-workload",
        start=args.start,
        records=args.records,
        trace=args.trace,
        requests=args.requests,
        seed=args.seed,
        zipf_s=args.zipf,
        reformulate=args.reformulate,
        distinct=args.distinct,
        concurrency=concurrency,
        rate=args.rate,
        max_tokens=args.max_tokens,
        max_seconds=args.max_seconds,
        keep=args.keep,
        answer_fidelity=args.answer_fidelity,
        floor=args.floor,
        progress=sys.stderr.isatty(),
    )


def _default(key: str):
    return {"records": 12, "requests": 32, "modes": DEFAULT_MODES, "max_tokens": 32}[key]


def run_workload_command(args) -> int:
    from app.cli.common import settings_overrides
    from app.settings import Settings
    from bench.extras import require
    from bench.workload.report import (
        format_answers,
        format_bounds,
        format_table,
        write_json,
        write_report,
    )
    from bench.workload.workload import Server, run_workload
    from engine.engine import Engine
    from engine.serving.threads import in_own_thread, single_threaded
    from retrieval.embedder import Embedder

    if args.report:  # before the run: its plots need the bench extra
        require("matplotlib")
    values = settings_overrides(args)
    base = Settings(**values)
    options = workload_options(args, base.data_dir)
    values.update(
        database_url="",
        store_tiers=args.tiers,
        default_max_tokens=options.max_tokens,
        max_tokens_limit=max(options.max_tokens, base.max_tokens_limit),
    )
    for flag, field in (("workers", "workers"), ("queue_size", "queue_size")):
        if getattr(args, flag) is not None:
            values[field] = getattr(args, flag)
    values.setdefault("workers", base.workers)
    values.setdefault("queue_size", base.queue_size)
    engine = Engine.load(base.engine_config())
    server = Server(
        engine.loaded,
        in_own_thread(partial(Embedder, base.embedder_path, linear_kernel=base.linear_kernel)),
        values,
    )
    # this thread only coordinates from here on (engine/serving/threads.py: stray pools)
    single_threaded()
    run = run_workload(options, server, say=lambda line: print(line, flush=True))
    print(format_table(run.summaries))
    if bounds := format_bounds(run):
        print(bounds)
    print(format_answers(run))
    command = "kvmosaic " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.json:
        write_json(run, args.json)
        print(f"wrote {args.json}")
    if args.report:
        print(f"wrote {write_report(run, args.report, command)}")
    return 0
