"""Learned chunk packets on answerable cases: train on some seeds, judge on others.

    python -m bench.fidelity.packets --model smollm2-135m --train-seed 8 --train-n 300 \\
        --eval-seed 7 --eval-n 50 --budget-s 900 --out packets.safetensors

Trains packets (engine/adapt/) on generated cases of `--train-seed` (their chunks in a seeded
random order each, full prefill's greedy answers as the teacher; a tenth held back for the
KL that picks the best step), then answers `--eval-n` cases of `--eval-seed` in two chunk
orders three ways through the same Hugging Face path: full prefill, plain reuse (each chunk's
base alone, moved, nothing recomputed: `naive`), and reuse with the packets (nothing
recomputed either). Prints gold containment per row with its 95% interval and paired
differences, and the reuse rows' answers identical to full's. Every cost is printed: the
teacher's answers, training time, the packets' extra rows per chunk.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.fidelity.adapt import AdaptOptions, adapt
from bench.fidelity.cases import generate_cases
from bench.fidelity.reading import judge
from engine.adapt.train import SCHEDULES
from engine.config import EngineConfig
from engine.engine import Engine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--train-seed", dest="seed", type=int, default=8)
    parser.add_argument("--train-n", dest="n", type=int, default=300)
    parser.add_argument("--eval-seed", type=int, default=7)
    parser.add_argument("--eval-n", type=int, default=50)
    parser.add_argument("--budget-s", type=float, default=900.0)
    parser.add_argument(
        "--train-chunks", dest="chunks", type=int, default=3, help="chunks per training prompt"
    )
    parser.add_argument("--head", type=int, default=8)
    parser.add_argument("--tail", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="constant",
        help="the rate along the budget: constant, or cosine down to 0 at its end (constant)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: the engine's)")
    parser.add_argument("--out", type=Path, required=True, help="the trained packets' file")
    parser.add_argument("--init", type=Path, default=None, help="go on training these packets")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, linear_kernel="torch"
    )
    engine = Engine.load(config)  # torch's linear: oneDNN's has no backward
    options = AdaptOptions.of_args(args, args.out)
    adapted = adapt(engine, options)
    distiller, packets, report = adapted.distiller, adapted.packets, adapted.report
    meta = {"model": args.model, **adapted.meta}
    teacher_s = adapted.teacher_s
    readers = {
        "naive": lambda e: distiller.reused_answer(e, None, args.max_new_tokens),
        "packets": lambda e: distiller.reused_answer(e, packets, args.max_new_tokens),
    }
    cases = generate_cases(args.eval_seed, args.eval_n)
    figures = judge(engine, distiller, cases, readers, args.eval_seed, args.max_new_tokens, "naive")
    summary = {
        **meta,
        "teacher_s": teacher_s,
        "train_s": report.seconds,
        "curve": report.curve,
        "extra_rows_per_chunk": packets.extra_rows,
        "eval_seed": args.eval_seed,
        "eval_n": args.eval_n,
        "rows": figures,
        "threads": torch.get_num_threads(),
        "dtype": str(engine.loaded.dtype),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
