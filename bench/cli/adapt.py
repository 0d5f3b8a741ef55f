"""`kvmosaic adapt`: train a model's learned chunk packets (engine/adapt/) by self-distillation.

    kvmosaic adapt --model qwen2.5-coder-0.5b --budget-s 3600

Generated tuning cases (bench/fidelity/cases.py), full prefill as the teacher, a tenth held
back; a progress bar while the teacher answers and while training runs; the best packets on the
held-back split go to `packets.safetensors` beside the model's converted checkpoint (or `--out`)
as they are found. The model loads with torch's linear layers (oneDNN's have no backward) in
the dtype `--dtype` names (default the engine's: bfloat16 where the CPU computes it natively).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from app.cli.common import add_engine_arguments, engine_config


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "adapt", help="train a model's learned chunk packets (nothing recomputed at reuse)"
    )
    add_engine_arguments(parser)
    parser.add_argument("--seed", type=int, default=8, help="tuning seed of the cases (0-999)")
    parser.add_argument("--n", type=int, default=400, help="cases, a tenth held back (400)")
    parser.add_argument("--chunks", type=int, default=3, help="passages per prompt (3)")
    parser.add_argument("--head", type=int, default=8, help="soft tokens before a chunk (8)")
    parser.add_argument("--tail", type=int, default=8, help="soft tokens after a chunk (8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's rate (0.001)")
    parser.add_argument(
        "--schedule",
        default="constant",
        help="the rate along the budget: constant, or cosine down to 0 at its end (constant)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=1800.0, help="training time, seconds (1800)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=16, help="teacher answer length")
    parser.add_argument(
        "--init", type=Path, default=None, help="go on training these packets (a packets file)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the packets file (default: beside the checkpoint)"
    )
    parser.set_defaults(handler=run)


def run(args) -> int:
    from bench.fidelity.adapt import AdaptOptions, adapt
    from engine.adapt.packets import PACKETS_FILE
    from engine.engine import Engine
    from engine.model.known import checkpoint_of

    config = dataclasses.replace(engine_config(args), linear_kernel="torch", packets=None)
    out = args.out or checkpoint_of(config.data_dir, config.model, config.model_path) / PACKETS_FILE
    options = AdaptOptions.of_args(args, out)
    options.check()  # before the model loads
    adapted = adapt(Engine.load(config), options)
    report = adapted.report
    print(json.dumps({**adapted.meta, "teacher_s": round(adapted.teacher_s, 1)}, indent=1))
    print(
        f"held-back KL: {report.held_kl_plain:.4f} without packets, {report.held_kl_start:.4f} "
        f"at the start, {report.held_kl_best:.4f} best (step {report.best_step} of "
        f"{report.steps}, {report.seconds:.0f} s{', interrupted' if report.interrupted else ''})"
    )
    print(f"wrote {out}")
    print(
        "judge them: kvmosaic bench fidelity --packets "
        f"{out} --modes 'full,naive@fast,naive@fast[packets=1]' (on a report seed's cases)"
    )
    return 0
