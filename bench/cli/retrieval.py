"""`kvmosaic bench retrieval`: the approximate vector index against the exact one
(bench/retrieval.py)."""

from __future__ import annotations

from pathlib import Path


def add_retrieval_parser(kinds) -> None:
    p = kinds.add_parser(
        "retrieval", help="IVF index vs exact flat index: search latency, recall@10, memory"
    )
    p.add_argument(
        "--sizes", default="10000,100000,1000000", help="rows of synthetic vectors, comma-separated"
    )
    p.add_argument("--dim", type=int, default=384, help="vector dimension (default 384, MiniLM's)")
    p.add_argument(
        "--queries", type=int, default=200, help="single-vector searches per index (default 200)"
    )
    p.add_argument(
        "--nprobe",
        type=int,
        default=None,
        help="IVF lists searched (default KVMOSAIC_INDEX_NPROBE)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.set_defaults(handler=run_retrieval)


def run_retrieval(args) -> int:
    from bench.retrieval import HEADER, RetrievalBenchOptions, run_retrieval_bench, write_json

    options = RetrievalBenchOptions(
        sizes=tuple(int(s) for s in args.sizes.split(",") if s.strip()),
        dim=args.dim,
        queries=args.queries,
        nprobe=args.nprobe or _configured_nprobe(),
        seed=args.seed,
    )
    print(
        f"synthetic unit vectors near a {options.latent}-dim subspace, dim {options.dim}, "
        f"{options.queries} single-query searches on 1 thread; recall@10 against the flat index"
    )
    print(HEADER)
    rows = run_retrieval_bench(options)
    if args.json:
        write_json(rows, options, args.json)
        print(f"wrote {args.json}")
    return 0


def _configured_nprobe() -> int:
    from app.settings import Settings

    return Settings().index_nprobe
