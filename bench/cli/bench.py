"""`kvmosaic bench fidelity|kernels|decode ...`: benchmarks that print ratios measured in the same
run."""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from pathlib import Path

from app.cli.common import (
    add_dataset_arguments,
    add_engine_arguments,
    add_warmup_arguments,
    engine_config,
)
from app.store.codec_names import CODEC_NAMES
from bench.cli.compute import add_invariance_parser, add_prefill_parser
from bench.cli.demo import add_demo_parser
from bench.cli.ingest import add_ingest_parser
from bench.cli.retrieval import add_retrieval_parser
from bench.cli.workload import add_workload_parser
from engine.config import FIDELITIES


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark")
    kinds = bench.add_subparsers(dest="bench", required=True)
    fidelity = kinds.add_parser(
        "fidelity", help="TTFT and fidelity of every mode against full prefill"
    )
    add_engine_arguments(fidelity)
    add_dataset_arguments(fidelity)
    fidelity.add_argument(
        "--modes",
        default="full,naive,epic,cacheblend",
        help="comma-separated modes; `mode@fast|balanced|exact` sets that row's fidelity guard "
        "level; `mode[key=value;...]` its engine settings, `codec=NAME` a store codec, "
        "`neighbours=K;lead_tokens=T` neighbour-conditioned bases (bench/fidelity/neighbours.py), "
        "`packets=1` chunks between learned packets (--packets)",
    )
    fidelity.add_argument(
        "--fidelity",
        choices=FIDELITIES,
        default=None,
        help="guard level of rows that name none (default: KVMOSAIC_FIDELITY)",
    )
    fidelity.add_argument(
        "--ratio", type=float, default=None, help="recompute ratio r (default from config)"
    )
    fidelity.add_argument("--max-new-tokens", type=int, default=32)
    fidelity.add_argument(
        "--orders",
        type=int,
        default=3,
        help="chunk orders per record: the dataset's, then seeded shuffles; full prefill in the "
        "others against the first is the stability floor (default 3; 1: no floor)",
    )
    add_warmup_arguments(fidelity)
    fidelity.add_argument(
        "--store-codecs",
        default=None,
        help="instead of the timed table: chunk KV through each KV codec, e.g. float16,int4,k4v3 "
        "(the first is the baseline); first-token KL / top-1 of each mode, answer-position top-1 / "
        "KL "
        "along full's answer (teacher forcing, --max-new-tokens) and bytes per token on "
        "the same requests (cold variants)",
    )
    fidelity.add_argument(
        "--packets",
        type=Path,
        default=None,
        help="load these learned packets (`kvmosaic adapt`); rows naming `packets=1` read every "
        "chunk between them",
    )
    fidelity.add_argument("--json", type=Path, default=None, help="also write the figures here")
    fidelity.set_defaults(handler=run_fidelity)
    add_fidelity_merge_parser(kinds)
    add_kernels_parser(kinds)
    add_decode_parser(kinds)
    add_decode_load_parser(kinds)
    add_store_parser(kinds)
    add_workload_parser(kinds, add_engine_arguments)
    add_ingest_parser(kinds, add_engine_arguments)
    add_demo_parser(kinds, add_engine_arguments)
    add_retrieval_parser(kinds)
    add_invariance_parser(kinds)
    add_prefill_parser(kinds)


def add_fidelity_merge_parser(kinds) -> None:
    merge = kinds.add_parser(
        "fidelity-merge",
        help="one fidelity report from shards: `bench fidelity --json` runs of the same rows over "
        "disjoint --start/--n ranges",
    )
    merge.add_argument("shards", type=Path, nargs="+", help="the shards' JSON files")
    merge.add_argument("--json", type=Path, default=None, help="also write the merged figures here")
    merge.add_argument(
        "--pair",
        action="append",
        default=[],
        metavar="ROW,AGAINST",
        help="also print ROW's accuracy minus AGAINST's, paired case by case (repeatable)",
    )
    merge.add_argument(
        "--frontier",
        action="store_true",
        help="also print the rows as the frontier table's markdown (accuracy, TTFT, recompute, "
        "ingest and stored KV per chunk token)",
    )
    merge.set_defaults(handler=run_fidelity_merge)


def run_fidelity_merge(args) -> int:
    from bench.fidelity.fidelity import write_report
    from bench.fidelity.merge import load_shard, merge_shards, paired_rows

    options, summaries = merge_shards([load_shard(path) for path in args.shards])
    ranges = ", ".join(f"{s['start']}..{s['start'] + s['n'] - 1}" for s in options["shards"])
    header = (
        f"records {ranges} of {Path(options['dataset']).name} ({options['n']} in "
        f"{len(options['shards'])} shards), {options['chunks']} chunks"
    )
    status = _print_fidelity(header, summaries, args.json, partial(write_report, options))
    for pair in args.pair:
        row, _, against = pair.rpartition(",")
        delta = paired_rows(summaries, row, against)
        print(f"{row} - {against}: {delta.mean:+.3f} [{delta.low:+.3f}, {delta.high:+.3f}]")
    if args.frontier:
        from bench.fidelity.frontier import frontier_table

        print()
        print(frontier_table(summaries))
    return status


def _print_fidelity(header: str, summaries, path: Path | None, write) -> int:
    """Print a fidelity report's header line and table; `write(summaries, path)` when a path
    is given."""
    from bench.fidelity.fidelity import format_table

    print(header)
    print(format_table(summaries))
    if path:
        write(summaries, path)
        print(f"wrote {path}")
    return 0


def add_kernels_parser(kinds) -> None:
    kernels = kinds.add_parser("kernels", help="each CUDA kernel against its PyTorch eager twin")
    kernels.add_argument(
        "--device", default="cuda", help="cuda (cpu only smoke-tests the host twins)"
    )
    kernels.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    kernels.add_argument("--tokens", type=int, default=1536, help="prompt rows (default 1536)")
    kernels.add_argument(
        "--repeats", type=int, default=200, help="timed calls per op (default 200)"
    )
    kernels.add_argument("--json", type=Path, default=None, help="also write the figures here")
    kernels.set_defaults(handler=run_kernels)


def run_fidelity(args) -> int:
    from bench.fidelity.fidelity import FidelityOptions, run_fidelity, write_json
    from engine.engine import Engine
    from engine.serving.threads import single_threaded

    options = FidelityOptions(
        dataset=args.dataset,
        start=args.start,
        n=args.n,
        chunks=args.chunks,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        ratio=args.ratio,
        max_new_tokens=args.max_new_tokens,
        warmup_orders=args.warmup_orders,
        seed=args.seed,
        fidelity=args.fidelity,
        orders=args.orders,
    )
    config = engine_config(args)
    if args.packets is not None:
        config = dataclasses.replace(config, packets=str(args.packets))
    engine = Engine.load(config)
    # this thread computes metrics, never in a pool of its own (engine/serving/threads.py)
    single_threaded()
    if args.store_codecs:
        return run_codec_fidelity(args, engine, options)
    summaries = run_fidelity(engine, options, codecs=_row_codecs(options.modes))
    header = (
        f"records {options.start}..{options.start + options.n - 1} of {options.dataset.name}, "
        f"{options.chunks} chunks, model {engine.fingerprint}, device {engine.device}"
    )
    return _print_fidelity(
        header, summaries, args.json, lambda rows, path: write_json(rows, options, path)
    )


def _row_codecs(labels) -> dict:
    """The store codecs that rows name (`cachecraft[codec=ch4v3]`), as KV round trips."""
    from app.store.entry import roundtrip
    from bench.fidelity.fidelity import CODEC, settings_of

    names = {settings_of(label).get(CODEC) for label in labels} - {None}
    return {name: (lambda kv, name=name: roundtrip(kv, name)) for name in names}


def run_codec_fidelity(args, engine, options) -> int:
    import json

    from bench.fidelity.codecs import (
        CodecOptions,
        codec_json,
        format_codec_table,
        run_codec_fidelity,
    )

    codec_options = CodecOptions(
        dataset=options.dataset,
        start=options.start,
        n=options.n,
        chunks=options.chunks,
        codecs=tuple(c.strip() for c in args.store_codecs.split(",") if c.strip()),
        modes=options.modes,
        ratio=options.ratio,
        max_new_tokens=options.max_new_tokens,
        fidelity=options.fidelity,
    )
    report = run_codec_fidelity(engine, codec_options)
    print(
        f"records {options.start}..{options.start + options.n - 1} of {options.dataset.name}, "
        f"{options.chunks} chunks, model {engine.fingerprint}, device {engine.device}, "
        f"guard {options.fidelity or engine.config.fidelity.value}; chunk KV through each codec"
    )
    print(format_codec_table(report))
    if args.json:
        args.json.write_text(json.dumps(codec_json(report), indent=2))
        print(f"wrote {args.json}")
    return 0


def run_kernels(args) -> int:
    import torch

    from bench.compute.kernels import KernelBenchOptions, format_table, run_kernel_bench, write_json

    options = KernelBenchOptions(
        device=args.device,
        dtype=getattr(torch, args.dtype),
        tokens=args.tokens,
        repeats=args.repeats,
    )
    timings = run_kernel_bench(options)
    print(
        f"kernels vs PyTorch eager twins on {args.device}, {args.dtype}, {args.tokens} prompt rows"
    )
    print(format_table(timings))
    if args.json:
        write_json(timings, options, args.json)
        print(f"wrote {args.json}")
    return 0


def add_decode_parser(kinds) -> None:
    decode = kinds.add_parser(
        "decode",
        help="time per output token at several stream counts, beside the weight-read floor",
    )
    add_engine_arguments(decode)
    decode.add_argument(
        "--streams", default="1,2,4,8", help="stream counts, comma-separated (default 1,2,4,8)"
    )
    decode.add_argument(
        "--context", type=int, default=1500, help="cache tokens per stream (default 1500)"
    )
    decode.add_argument("--steps", type=int, default=32, help="timed steps per round")
    decode.add_argument("--rounds", type=int, default=3, help="rounds per stream count")
    decode.add_argument(
        "--weights",
        default=None,
        help="decode weights to compare in the same run, comma-separated: model, bfloat16, int8, "
        "int4, and twin (the PyTorch step the native one replaces); default: the engine's own",
    )
    decode.add_argument(
        "--no-profile", action="store_true", help="skip the instrumented pass (profile split)"
    )
    decode.add_argument("--json", type=Path, default=None, help="also write the figures here")
    decode.set_defaults(handler=run_decode)


def run_decode(args) -> int:
    import json

    from bench.compute.decode import (
        cpu_name,
        figures_json,
        format_report,
        format_summary,
        run_decode_bench,
        variant_stacks,
    )
    from engine.engine import Engine
    from engine.serving.threads import single_threaded

    engine = Engine.load(engine_config(args))
    single_threaded()  # this thread only reports (engine/serving/threads.py)
    weights = [w.strip() for w in (args.weights or "").split(",") if w.strip()]
    runs = run_decode_bench(
        engine,
        streams=tuple(int(s) for s in args.streams.split(",") if s.strip()),
        context=args.context,
        steps=args.steps,
        rounds=args.rounds,
        profile=not args.no_profile,
        stacks=variant_stacks(engine, weights) if weights else None,
    )
    print(f"decode on {cpu_name()}: {engine.summary}")
    for figures in runs:
        print(format_report(figures))
        print()
    if len(runs) > 1:
        print(format_summary(runs))
    if args.json:
        args.json.write_text(json.dumps([figures_json(f) for f in runs], indent=2))
        print(f"wrote {args.json}")
    engine.close()
    return 0


def add_decode_load_parser(kinds) -> None:
    load = kinds.add_parser(
        "decode-load",
        help="time between a stream's tokens while full prefills keep the compute thread busy, "
        "per decode_gap_ms setting",
    )
    add_engine_arguments(load)
    load.add_argument(
        "--gaps",
        default="off,100,0",
        help="decode_gap_ms settings to compare, comma-separated; off: prefills run whole "
        "(default off,100,0)",
    )
    load.add_argument("--streams", type=int, default=1, help="streams decoding (default 1)")
    load.add_argument(
        "--prefills", type=int, default=3, help="full prefills per setting, back to back"
    )
    load.set_defaults(handler=run_decode_load)


def run_decode_load(args) -> int:
    from bench.compute.decode import cpu_name
    from bench.compute.decode_load import format_report, run_decode_load
    from engine.engine import Engine
    from engine.serving.threads import single_threaded

    gaps = [None if g.strip() == "off" else float(g) for g in args.gaps.split(",") if g.strip()]
    if args.streams < 1 or args.prefills < 1 or not gaps:
        raise SystemExit("--streams and --prefills must be >= 1, --gaps must name a setting")
    engine = Engine.load(engine_config(args))
    single_threaded()  # this thread asks for the load's prefills and reports
    print(f"decode under load on {cpu_name()}: {engine.summary}", flush=True)
    try:
        base, figures = run_decode_load(engine, gaps, args.streams, args.prefills)
    finally:
        engine.close()
    print(format_report(base, figures))
    return 0


def add_store_parser(kinds) -> None:
    store = kinds.add_parser(
        "store", help="KV store tiers against raw file I/O, and load/compute overlap"
    )
    add_engine_arguments(store)
    store.add_argument(
        "--tiers",
        default="gpu,cpu,disk,redis",
        help="tiers to measure (unavailable ones are skipped)",
    )
    store.add_argument(
        "--repeats", type=int, default=5, help="entries per tier and size (default 5)"
    )
    store.add_argument(
        "--codec",
        "--storage-dtype",
        dest="codec",
        default="float16",
        choices=CODEC_NAMES,
        help="KV codec of the entries",
    )
    store.add_argument(
        "--redis-url", default=os.environ.get("KVMOSAIC_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    store.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="scratch directory on the disk to measure (default <data-dir>/bench)",
    )
    store.add_argument(
        "--no-fsync", action="store_true", help="disk tier and raw baseline without fsync"
    )
    store.add_argument(
        "--chunks", type=int, default=6, help="chunks of the blended request (default 6)"
    )
    store.add_argument("--chunk-tokens", type=int, default=512)
    store.add_argument("--blend-repeats", type=int, default=3)
    store.add_argument(
        "--skip-overlap", action="store_true", help="throughput only (loads no model)"
    )
    store.add_argument(
        "--capacity",
        action="store_true",
        help="also: hit rate of a capped tier under a Zipf trace, per policy and capacity",
    )
    store.add_argument(
        "--capacity-fractions",
        default="0.1,0.25,0.5",
        help="tier caps, as shares of the corpus's KV",
    )
    store.add_argument("--capacity-policies", default="lru,lfu,value")
    store.add_argument("--capacity-tier", choices=["disk", "redis"], default="disk")
    store.add_argument("--capacity-entries", type=int, default=300)
    store.add_argument("--capacity-accesses", type=int, default=3000)
    store.add_argument(
        "--zipf-s", type=float, default=1.2, help="Zipf exponent of the trace (default 1.2)"
    )
    store.add_argument("--json", type=Path, default=None, help="also write the figures here")
    store.set_defaults(handler=run_store)


def run_store(args) -> int:
    from bench.store.tiers import (
        StoreBenchOptions,
        default_work_dir,
        format_codec_sizes,
        format_overlap,
        format_throughput,
        run_overlap,
        run_throughput,
        write_json,
    )

    options = StoreBenchOptions(
        tiers=tuple(t.strip() for t in args.tiers.split(",") if t.strip()),
        repeats=args.repeats,
        dtype=args.codec,
        redis_url=args.redis_url,
        work_dir=args.work_dir or engine_config(args).data_dir / "bench",
        fsync=not args.no_fsync,
        chunks=args.chunks,
        chunk_tokens=args.chunk_tokens,
        blend_repeats=args.blend_repeats,
    )
    overlap = capacity = None
    print(format_codec_sizes())
    with default_work_dir(options) as work:
        rows = run_throughput(options, Path(work))
        print(format_throughput(rows))
        if not args.skip_overlap:
            from engine.engine import Engine

            overlap = run_overlap(Engine.load(engine_config(args)), options, Path(work))
            print(format_overlap(overlap))
        if args.capacity:
            capacity = run_store_capacity(args, Path(work))
    if args.json:
        write_json(rows, overlap, options, args.json, capacity)
        print(f"wrote {args.json}")
    return 0


def run_store_capacity(args, work: Path):
    from app.store.quant import get_codec
    from bench.store.capacity import CapacityOptions, format_capacity, run_capacity

    options = CapacityOptions(
        fractions=tuple(float(f) for f in args.capacity_fractions.split(",") if f.strip()),
        policies=tuple(p.strip() for p in args.capacity_policies.split(",") if p.strip()),
        tier=args.capacity_tier,
        entries=args.capacity_entries,
        accesses=args.capacity_accesses,
        zipf_s=args.zipf_s,
        codec=args.codec if get_codec(args.codec).lossy else "int4",
        redis_url=args.redis_url,
    )
    result = run_capacity(options, work / "capacity")
    print(format_capacity(result, options))
    return result
