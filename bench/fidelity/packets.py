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
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.fidelity.accuracy import bootstrap, paired_difference, per_case_means, score_answer
from bench.fidelity.cases import generate_cases
from bench.fidelity.fidelity import chunk_orders
from engine.adapt.packets import Packets, prefix_rows
from engine.adapt.train import Distiller, Example, train
from engine.config import EngineConfig
from engine.engine import Engine

CHUNKS = 6
ROWS = ("full", "naive", "packets")


def examples_of(
    engine: Engine,
    distiller: Distiller,
    cases: list[dict[str, Any]],
    seed: int,
    max_new: int,
    train_chunks: int,
) -> list[Example]:
    """The first `train_chunks` of each case's chunks in a seeded random order, with full
    prefill's greedy answer and its teacher log-probs."""
    rng = random.Random(seed)
    out = []
    for case in tqdm(cases, desc="teacher", file=sys.stderr):
        chunks = [engine.chunk_ids(c["text"], c.get("title", "")) for c in case["ctxs"][:CHUNKS]]
        rng.shuffle(chunks)
        question = engine.prompts.question_ids(case["question"])
        out.append(distiller.full_example(chunks[:train_chunks], question, max_new))
    return out


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
    model = engine.loaded.model
    distiller = Distiller(
        model,
        prefix_rows(model, engine.prompts.prefix_ids),
        engine.stack.inv_freq,
        engine.loaded.eos_token_ids,
    )
    began = time.monotonic()
    cases = generate_cases(args.train_seed, args.train_n)
    every = examples_of(
        engine, distiller, cases, args.train_seed, args.max_new_tokens, args.train_chunks
    )
    held_n = max(4, len(every) // 10)
    teacher_s = time.monotonic() - began
    separator = engine.loaded.tokenizer("\n\n", add_special_tokens=False).input_ids
    start = (
        Packets.load(args.init)[0]
        if args.init
        else Packets.initial(model, separator, args.head, args.tail)
    )
    packets, report = train(
        distiller, every[held_n:], every[:held_n], start, args.budget_s, args.lr
    )
    meta = {
        "model": args.model,
        "fingerprint": engine.fingerprint,
        "train_seed": args.train_seed,
        "train_n": args.train_n,
        "train_chunks": args.train_chunks,
        "init": str(args.init) if args.init else None,
        "steps": report.steps,
        "best_step": report.best_step,
        "held_kl": [report.held_kl_plain, report.held_kl_start, report.held_kl_best],
    }
    packets.save(args.out, meta)
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
