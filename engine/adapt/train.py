"""Packets trained by self-distillation: the model's own full prefill is the teacher.

An example is a prompt's chunks and question and full prefill's greedy answer to it (no labels).
A step prefills the prompt in full (no gradient) and assembles it by reuse with the packets
around every chunk (engine/adapt/packets.py); the loss is KL(full ‖ reuse) of the next-token
distributions along full's answer, its first token included. Only the packets learn. A held-back
split's mean KL is measured before training (reuse without packets, and with the starting
packets) and every `eval_every` steps; the best packets on it are kept. A time budget ends it;
the rate is constant or decays along the budget (`SCHEDULES`).
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from engine.adapt.packets import KVRows, Packets, logits_after, reused_cache
from engine.model.linear import linear_kernel_of

TEACHER_TOP = 64  # teacher log-probs kept per answer position (the rest of the mass is dropped)
# How the rate moves along the time budget: "constant", or "cosine" from the given rate at the
# start to 0 when the budget ends (a budget is time, not steps: the decay follows the clock).
SCHEDULES = ("constant", "cosine")


def rate_at(lr: float, schedule: str, spent: float) -> float:
    """The rate after `spent` of the budget (0..1, clipped) under `schedule`."""
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * min(max(spent, 0.0), 1.0)))
    raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")


@dataclass(frozen=True)
class Example:
    """One prompt: its chunks' token ids, its question suffix, full prefill's greedy answer and,
    along it (its end included), the teacher's `TEACHER_TOP` most likely tokens: log-probs and
    ids, [answer + 1, TEACHER_TOP] each (None where only the answer is needed)."""

    chunks: tuple[tuple[int, ...], ...]
    question_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class TrainReport:
    """What training did: steps, seconds, held-back KL without packets, at the start, best."""

    steps: int = 0
    seconds: float = 0.0
    held_kl_plain: float = math.nan
    held_kl_start: float = math.nan
    held_kl_best: float = math.nan
    best_step: int = 0
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-back KL)
    interrupted: bool = False  # Ctrl-C ended it before the budget


class Distiller:
    """The frozen model, its prefix's KV and its rotary frequencies: teacher and student."""

    def __init__(
        self, model: PreTrainedModel, prefix: KVRows, inv_freq: torch.Tensor, eos: Sequence[int]
    ):
        if linear_kernel_of(model) != "torch":
            # oneDNN's packed linear has no backward: the packets would get no gradient
            raise ValueError("training packets needs the model loaded with linear_kernel torch")
        self.model, self.prefix, self.inv_freq = model, prefix, inv_freq
        self.eos = frozenset(eos)
        for parameter in model.parameters():
            parameter.requires_grad_(False)

    @property
    def start(self) -> int:
        return self.prefix[0][0].shape[2]

    def full_cache(self) -> DynamicCache:
        return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in self.prefix])

    def greedy(
        self, cache: DynamicCache, position: int, ids: Sequence[int], max_new: int
    ) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """The greedy continuation of `ids` read at `position` over `cache`, up to an end token,
        and the log-probs it was read from (one per answer token, and the last)."""
        with torch.no_grad():
            logits = logits_after(self.model, cache, position, ids, last_only=True)[-1]
            position += len(ids)
            out: list[int] = []
            steps = [torch.log_softmax(logits, -1)]
            while len(out) < max_new:
                token = int(logits.argmax())
                if token in self.eos:
                    break
                out.append(token)
                logits = logits_after(self.model, cache, position, [token])[-1]
                steps.append(torch.log_softmax(logits, -1))
                position += 1
        return tuple(out), steps

    def full_example(
        self, chunks: Sequence[Sequence[int]], question: Sequence[int], max_new: int
    ) -> Example:
        """The prompt with full prefill's greedy answer and its teacher log-probs."""
        ids = [t for chunk in chunks for t in chunk] + list(question)
        answer, steps = self.greedy(self.full_cache(), self.start, ids, max_new)
        top = torch.stack(steps).topk(TEACHER_TOP, dim=-1)
        return Example(
            tuple(map(tuple, chunks)), tuple(question), answer, (top.values, top.indices)
        )

    def reused_answer(
        self, example: Example, packets: Packets | None, max_new: int
    ) -> tuple[int, ...]:
        with torch.no_grad():
            cache, position = reused_cache(
                self.model, self.prefix, example.chunks, packets, self.inv_freq
            )
        return self.greedy(cache, position, example.question_ids, max_new)[0]

    def kl(self, example: Example, packets: Packets | None) -> torch.Tensor:
        """Mean KL(full ‖ reuse) along full's answer over the teacher's top tokens
        (differentiable in the packets)."""
        if example.teacher is None:
            raise ValueError("the example has no teacher log-probs (Distiller.full_example)")
        values, indices = example.teacher
        cache, position = reused_cache(
            self.model, self.prefix, example.chunks, packets, self.inv_freq
        )
        tail = list(example.question_ids) + list(example.answer_ids)
        logits = logits_after(self.model, cache, position, tail)
        student = torch.log_softmax(logits[len(example.question_ids) - 1 :], -1)
        return (values.exp() * (values - student.gather(-1, indices))).sum(-1).mean()

    def held_kl(self, held: Sequence[Example], packets: Packets | None) -> float:
        with torch.no_grad():
            return sum(float(self.kl(e, packets)) for e in held) / len(held)


def train(
    distiller: Distiller,
    examples: Sequence[Example],
    held: Sequence[Example],
    packets: Packets,
    budget_s: float,
    lr: float = 1e-3,
    eval_every: int = 25,
    progress: bool = True,
    clock: Callable[[], float] = time.monotonic,
    on_best: Callable[[Packets, TrainReport], None] | None = None,
    schedule: str = "constant",
) -> tuple[Packets, TrainReport]:
    """Train `packets` on `examples` (in turn, again and again) until `budget_s` has passed
    or the user interrupts (Ctrl-C ends training, not the run), at rate `lr` moved along the
    budget by `schedule`; returns the best packets on `held` and the report. `on_best` sees
    every new best as it is found (to save it: a crash loses no more than the steps since).
    Nothing else changes."""
    if not examples or not held:
        raise ValueError("training needs examples and a held-back split")
    if schedule not in SCHEDULES:  # before the held-back KL is spent
        raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    report = TrainReport(held_kl_plain=distiller.held_kl(held, None))
    report.held_kl_start = report.held_kl_best = distiller.held_kl(held, packets)
    report.curve.append((0, report.held_kl_start))
    best = copy.deepcopy(packets)
    head = packets.head.clone().requires_grad_(True)
    tail = packets.tail.clone().requires_grad_(True)
    learning = Packets(head, tail)
    optimizer = torch.optim.AdamW([head, tail], lr=lr, weight_decay=0.0)
    began = clock()
    bar = tqdm(desc="adapt", unit="step", file=sys.stderr, disable=not progress)
    try:
        while (elapsed := clock() - began) < budget_s:
            for group in optimizer.param_groups:
                group["lr"] = rate_at(lr, schedule, elapsed / budget_s)
            example = examples[report.steps % len(examples)]
            loss = distiller.kl(example, learning)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            report.steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", held=f"{report.held_kl_best:.3f}")
            if report.steps % eval_every == 0:
                current = Packets(head.detach().clone(), tail.detach().clone())
                score = distiller.held_kl(held, current)
                report.curve.append((report.steps, score))
                if score < report.held_kl_best:
                    report.held_kl_best, report.best_step, best = score, report.steps, current
                    if on_best is not None:
                        on_best(best, report)
    except KeyboardInterrupt:
        report.interrupted = True
    bar.close()
    report.seconds = clock() - began
    return best, report
