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
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.fidelity.accuracy import bootstrap, paired_difference, per_case_means, score_answer
from bench.fidelity.adapt import AdaptOptions, adapt, distiller_of
from bench.fidelity.cases import generate_cases
from bench.fidelity.fidelity import chunk_orders
from engine.adapt.packets import Packets
from engine.adapt.train import Distiller
from engine.config import EngineConfig
from engine.engine import Engine

CHUNKS = 6
ROWS = ("full", "naive", "packets")


def judge(
    engine: Engine,
    distiller: Distiller,
    cases: list[dict[str, Any]],
    packets: Packets,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every row's answers on every case in two chunk orders, scored against the golds."""
    scores: dict[str, list[float]] = {row: [] for row in ROWS}
    same: dict[str, list[float]] = {row: [] for row in ROWS}
    case_of: list[int] = []
    for index, case in enumerate(tqdm(cases, desc="judge", file=sys.stderr)):
        chunks = [engine.chunk_ids(c["text"], c.get("title", "")) for c in case["ctxs"][:CHUNKS]]
        question = engine.prompts.question_ids(case["question"])
        for order in chunk_orders(list(range(len(chunks))), 2, args.eval_seed + index):
            ordered = [chunks[i] for i in order]
            example = distiller.full_example(ordered, question, args.max_new_tokens)
            full = example.answer_ids
            answers = {
                "full": full,
                "naive": distiller.reused_answer(example, None, args.max_new_tokens),
                "packets": distiller.reused_answer(example, packets, args.max_new_tokens),
            }
            for row, ids in answers.items():
                text = str(engine.loaded.tokenizer.decode(list(ids), skip_special_tokens=True))
                scores[row].append(float(score_answer(text, case["answers"]).contains))
                same[row].append(float(ids == full))
            case_of.append(index)
    per_case = {row: per_case_means(scores[row], case_of) for row in ROWS}
    out: dict[str, Any] = {}
    for row in ROWS:
        accuracy = bootstrap(per_case[row])
        versus = paired_difference(per_case[row], per_case["full"])
        out[row] = {
            "accuracy": [accuracy.mean, accuracy.low, accuracy.high],
            "vs_full": [versus.mean, versus.low, versus.high],
            "same_as_full": sum(same[row]) / len(same[row]),
        }
    gain = paired_difference(per_case["packets"], per_case["naive"])
    out["packets_vs_naive"] = [gain.mean, gain.low, gain.high]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--train-seed", type=int, default=8)
    parser.add_argument("--train-n", type=int, default=300)
    parser.add_argument("--eval-seed", type=int, default=7)
    parser.add_argument("--eval-n", type=int, default=50)
    parser.add_argument("--budget-s", type=float, default=900.0)
    parser.add_argument("--train-chunks", type=int, default=3, help="chunks per training prompt")
    parser.add_argument("--head", type=int, default=8)
    parser.add_argument("--tail", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
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
    options = AdaptOptions(
        out=args.out,
        seed=args.train_seed,
        n=args.train_n,
        chunks=args.train_chunks,
        head=args.head,
        tail=args.tail,
        lr=args.lr,
        budget_s=args.budget_s,
        max_new_tokens=args.max_new_tokens,
        init=args.init,
    )
    adapted = adapt(engine, options)
    distiller, packets, report = distiller_of(engine), adapted.packets, adapted.report
    meta = {"model": args.model, **adapted.meta}
    teacher_s = adapted.teacher_s
    figures = judge(engine, distiller, generate_cases(args.eval_seed, args.eval_n), packets, args)
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
