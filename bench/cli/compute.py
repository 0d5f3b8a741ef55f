"""`kvmosaic bench invariance` and `kvmosaic bench prefill`: the prefill path's bits and speed."""

from __future__ import annotations

from pathlib import Path


def add_invariance_parser(kinds) -> None:
    p = kinds.add_parser(
        "invariance",
        help="per prefill op, kernel and dtype: does a row's result depend on the rows computed "
        "with it; its speed against float32",
    )
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument(
        "--model",
        default=None,
        help="whose shapes: a model by name (`kvmosaic models`; default: the embedded SmolLM2)",
    )
    p.add_argument("--rows", type=int, default=2048, help="rows computed at once (default 2048)")
    p.add_argument(
        "--blocks",
        default=None,
        help="block sizes compared with all rows at once, comma-separated (default: "
        "bench.compute.invariance.BLOCKS)",
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument(
        "--ops", default=None, help="only the ops whose name contains one of these, comma-separated"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls per op (median)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--thread-counts",
        default="1",
        help="other CPU thread counts whose rows are compared with --threads' (comma-separated; "
        "default 1, the variant builder's)",
    )
    p.set_defaults(handler=run_invariance_command)


def run_invariance_command(args) -> int:
    import torch
    from transformers import AutoConfig

    from app.settings import Settings
    from bench.compute.invariance import BLOCKS, Shapes, format_table, run_invariance
    from bench.compute.machine import capability_lines
    from engine.model.known import checkpoint_of
    from engine.serving.threads import use_threads

    if args.threads:
        use_threads(args.threads)
    data_dir = args.data_dir or Settings().data_dir
    checkpoint = checkpoint_of(data_dir, args.model, None)
    shapes = Shapes.of(AutoConfig.from_pretrained(checkpoint, local_files_only=True))
    blocks = [int(b) for b in args.blocks.split(",") if b.strip()] if args.blocks else BLOCKS
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",") if name.strip()]
    for line in capability_lines():
        print(line)
    print(f"shapes of {checkpoint.name}: {shapes}; {args.rows} rows, random weights")
    only = tuple(o.strip() for o in args.ops.split(",") if o.strip()) if args.ops else None
    counts = [int(t) for t in args.thread_counts.split(",") if t.strip()]
    print(f"rows on {torch.get_num_threads()} threads against {counts} threads")
    results = run_invariance(
        shapes, args.rows, blocks, dtypes, args.repeats, only=only, threads=counts
    )
    print(format_table(results, args.rows, blocks))
    return 0


def add_prefill_parser(kinds) -> None:
    p = kinds.add_parser(
        "prefill",
        help="full prefill tokens/s per model, dtype and length, against the GEMM-peak floor "
        "measured in the same run and llama-bench's pp where installed",
    )
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument(
        "--models",
        default="smollm2-135m,qwen2.5-coder-0.5b",
        help="models by name, comma-separated (`kvmosaic models`)",
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--tokens", default="512,2048,8192", help="prompt lengths, comma-separated")
    p.add_argument(
        "--linear-kernel",
        default="auto",
        help="auto, torch or onednn (KVMOSAIC_LINEAR_KERNEL; engine/model/linear.py)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per length (median)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(handler=run_prefill_command)


def run_prefill_command(args) -> int:
    from app.settings import Settings
    from bench.compute.machine import capability_lines
    from bench.compute.prefill import format_table, llama_bench_status, measure_model
    from engine.model.known import SMOLLM2, embedded_gguf, known_model
    from engine.model.layers import DecoderStack
    from engine.model.linear import linear_kernel_of
    from engine.model.loader import load_model
    from engine.model.prefill_attention import kernel_for
    from engine.serving.threads import use_threads

    if args.threads:
        use_threads(args.threads)
    data_dir = args.data_dir or Settings().data_dir
    lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
    for line in capability_lines():
        print(line)
    rows = []
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        gguf = embedded_gguf() if known_model(name) is SMOLLM2 else None
        print(llama_bench_status(gguf))
        for dtype in (d.strip() for d in args.dtypes.split(",") if d.strip()):
            loaded = load_model(data_dir, None, "cpu", dtype, args.linear_kernel, name)
            attention = kernel_for(loaded.dtype, loaded.device)
            print(
                f"{name} {dtype}: linear kernel {linear_kernel_of(loaded.model)}, "
                f"prefill attention {attention}"
            )
            stack = DecoderStack(loaded)
            rows += measure_model(name, dtype, stack, lengths, args.repeats, gguf)
    print(format_table(rows))
    return 0
