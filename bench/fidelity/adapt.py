"""Train a model's learned packets on generated tuning cases (`kvmosaic adapt`).

The cases are those of bench/fidelity/cases.py for one tuning seed: each case's first
`chunks` passages in a seeded random order and its question, with full prefill's greedy answer
as the teacher (engine/adapt/train.py). A tenth (at least 4) is held back: its KL picks the
best step. The packets file is written as each best step is found, so an interrupted or
crashed run keeps what it had learned.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.fidelity.cases import TUNING_SEEDS, generate_cases
from engine.adapt.packets import Packets, prefix_rows
from engine.adapt.train import SCHEDULES, Distiller, Example, TrainReport, train
from engine.engine import Engine
from engine.errors import InvalidRequest

PASSAGES_PER_CASE = 6  # what a case offers; a training prompt takes its first `chunks`


@dataclass(frozen=True)
class AdaptOptions:
    """How to train: cases, packet sizes, the optimizer's rate and the time budget."""

    out: Path
    seed: int = 8
    n: int = 400
    chunks: int = 3
    head: int = 8
    tail: int = 8
    lr: float = 1e-3
    schedule: str = "constant"  # the rate along the budget (engine/adapt/train.py SCHEDULES)
    budget_s: float = 1800.0
    max_new_tokens: int = 16
    init: Path | None = None  # go on training these packets

    @classmethod
    def of_args(cls, args: Any, out: Path) -> AdaptOptions:
        """The options a command line parsed (`seed`, `n`, `chunks`, `head`, `tail`, `lr`,
        `schedule`, `budget_s`, `max_new_tokens`, `init`), writing to `out`."""
        return cls(
            out=out,
            seed=args.seed,
            n=args.n,
            chunks=args.chunks,
            head=args.head,
            tail=args.tail,
            lr=args.lr,
            schedule=args.schedule,
            budget_s=args.budget_s,
            max_new_tokens=args.max_new_tokens,
            init=args.init,
        )

    def check(self) -> None:
        """InvalidRequest for options that cannot train (a report seed, too few cases)."""
        if self.seed not in TUNING_SEEDS:
            raise InvalidRequest(f"train on a tuning seed ({TUNING_SEEDS}), not {self.seed}")
        if self.n < 8:
            raise InvalidRequest(f"--n {self.n}: training needs at least 8 cases")
        if not 1 <= self.chunks <= PASSAGES_PER_CASE:
            raise InvalidRequest(f"--chunks must lie in 1..{PASSAGES_PER_CASE}")
        if self.budget_s <= 0:
            raise InvalidRequest("--budget-s must be positive")
        if self.schedule not in SCHEDULES:
            raise InvalidRequest(f"--schedule must be one of {', '.join(SCHEDULES)}")


@dataclass
class Adapted:
    """What `adapt` made: the packets, their training report, the file's meta, its costs and
    the distiller it trained with."""

    packets: Packets
    report: TrainReport
    meta: dict[str, Any]
    teacher_s: float
    distiller: Distiller  # the model as teacher and student, its prefix computed once


def distiller_of(engine: Engine) -> Distiller:
    """The engine's model as teacher and student (loaded with torch's linear layers)."""
    model = engine.loaded.model
    return Distiller(
        model,
        prefix_rows(model, engine.prompts.prefix_ids),
        engine.stack.inv_freq,
        engine.loaded.eos_token_ids,
    )


def training_examples(
    engine: Engine,
    distiller: Distiller,
    cases: Sequence[dict[str, Any]],
    seed: int,
    chunks: int,
    max_new_tokens: int,
    progress: bool = True,
) -> list[Example]:
    """The first `chunks` of each case's passages in a seeded random order, with full
    prefill's greedy answer and its teacher log-probs."""
    rng = random.Random(seed)
    out = []
    for case in tqdm(cases, desc="teacher", file=sys.stderr, disable=not progress):
        ids = [
            engine.chunk_ids(c["text"], c.get("title", ""))
            for c in case["ctxs"][:PASSAGES_PER_CASE]
        ]
        rng.shuffle(ids)
        question = engine.prompts.question_ids(case["question"])
        out.append(distiller.full_example(ids[:chunks], question, max_new_tokens))
    return out


def adapt(engine: Engine, options: AdaptOptions, progress: bool = True) -> Adapted:
    """Train packets for `engine`'s model by `options`; the best so far is in `options.out`
    from the first held-back improvement on, the best of the run at the end."""
    options.check()
    distiller = distiller_of(engine)
    began = time.monotonic()
    examples = training_examples(
        engine,
        distiller,
        generate_cases(options.seed, options.n),
        options.seed,
        options.chunks,
        options.max_new_tokens,
        progress,
    )
    teacher_s = time.monotonic() - began
    held_n = max(4, len(examples) // 10)
    separator = engine.loaded.tokenizer("\n\n", add_special_tokens=False).input_ids
    start = (
        Packets.load(options.init)[0]
        if options.init
        else Packets.initial(engine.loaded.model, separator, options.head, options.tail)
    )

    def meta_of(report: TrainReport) -> dict[str, Any]:
        return {
            "fingerprint": engine.fingerprint,
            "dtype": str(engine.loaded.dtype).removeprefix("torch."),
            "seed": options.seed,
            "cases": options.n,
            "held_back": held_n,
            "chunks": options.chunks,
            "lr": options.lr,
            "schedule": options.schedule,
            "init": str(options.init) if options.init else None,
            "steps": report.steps,
            "best_step": report.best_step,
            "held_kl": [report.held_kl_plain, report.held_kl_start, report.held_kl_best],
        }

    packets, report = train(
        distiller,
        examples[held_n:],
        examples[:held_n],
        start,
        options.budget_s,
        options.lr,
        progress=progress,
        on_best=lambda best, report: best.save(options.out, meta_of(report)),
        schedule=options.schedule,
    )
    meta = meta_of(report)
    packets.save(options.out, meta)
    return Adapted(packets, report, meta, teacher_s, distiller)
