"""The per-request fidelity guard: how far a reuse prefill may be from full prefill, and the fix.

A request names one of `FIDELITIES`:
- `exact`: the reference plan (full prefill), whatever the mode; the answer equals `full`'s.
- `fast`: the mode exactly as configured; nothing is estimated or spent.
- `balanced` (the default): the mode, watched twice.
  1. While the layers run, at every check layer (modes that select rows by score: cacheblend,
     and cachecraft's chunks planned by deviation) the kept rows must cover at least
     `guard_coverage` of the eligible rows' selection-score mass; the plan keeps more rows
     than the mode's ratio asks when the mass is spread (`planners/selection.py`). What it
     leaves stale at the last check layer is the request's `uncovered` share.
  2. At the first token: the blended state is far from full prefill exactly where the
     first-token distribution is flat, so when the log-probability margin of the top token
     over the runner-up is below `guard_margin` nats the prompt is prefilled again by the
     reference plan, and that result (equal to `full`'s) is what the request decodes.
The guard knows nothing about modes beyond the planner contract: a mode without check layers
(naive, epic, prefix) gets only the first-token check. This module does not decode, and it
never makes a request less faithful than its mode alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.config import FIDELITIES, EngineConfig
from engine.errors import InvalidRequest



@dataclass(frozen=True)
class GuardReport:
    """What the guard estimated and spent for one request.

    margin: log-probability margin (nats) of the first attempt's top token over the
    runner-up; uncovered: share of the last check layer's selection-score mass left on stale
    rows (None: the plan never selected rows by score); escalated: the answer comes from a
    second, full prefill; spent_s: seconds of that second prefill (0 when none), already
    inside the result's TTFT; threshold: the margin below which the guard escalates.
    """

    fidelity: str
    margin: float | None = None
    uncovered: float | None = None
    threshold: float | None = None
    escalated: bool = False
    spent_s: float = 0.0


def check_fidelity(fidelity: str | None, config: EngineConfig) -> str:
    """The request's level (config default when None); InvalidRequest if unknown."""
    fidelity = config.fidelity if fidelity is None else fidelity
    if fidelity not in FIDELITIES:
        raise InvalidRequest(f"unknown fidelity {fidelity!r}; known: {', '.join(FIDELITIES)}")
    return fidelity


def planning_config(config: EngineConfig, fidelity: str) -> EngineConfig:
    """The config a request's planner sees: coverage only when the guard watches it.

    A per-request copy, so the engine's shared config is never swapped under other threads.
    """
    coverage = config.guard_coverage if fidelity == "balanced" else 0.0
    return config if coverage == config.guard_coverage else dataclasses.replace(config, guard_coverage=coverage)


def first_token_margin(logits: torch.Tensor) -> float:
    """Log-probability of the top token minus the runner-up's, in nats (>= 0)."""
    top = torch.log_softmax(logits.double(), -1).topk(2).values
    return float(top[0] - top[1])


def should_escalate(margin: float, config: EngineConfig) -> bool:
    """True when the first token is too uncertain to trust the blended state."""
    return margin < config.guard_margin


class Guarded(NamedTuple):
    """The run a request keeps: its plan, the runner's output, the name of the planner that
    produced it (the reference's when the guard escalated) and the guard's report."""

    plan: object
    out: object
    planner_name: str
    report: GuardReport


def run_guarded(fidelity: str, config: EngineConfig, run: Callable[[object], tuple[object, object]],
                planner, reference) -> Guarded:
    """Prefill by the request's level; `run(planner)` plans and runs, returning (plan, out).

    exact: the reference alone. fast: the mode alone, its estimate reported. balanced: the
    mode, then the reference when `should_escalate` says the first token is too uncertain.
    A planner that reuses no cache (the reference itself, or a fallback) is never re-run.
    """
    if fidelity == "exact":
        plan, out = run(reference)
        return Guarded(plan, out, reference.name, GuardReport(fidelity))
    plan, out = run(planner)
    if not planner.reuses_cache:
        return Guarded(plan, out, planner.name, GuardReport(fidelity))
    report = GuardReport(fidelity, first_token_margin(out.logits), plan.uncovered, config.guard_margin)
    if fidelity == "fast" or not should_escalate(report.margin, config):
        return Guarded(plan, out, planner.name, report)
    started = time.perf_counter()
    plan, out = run(reference)
    spent = time.perf_counter() - started
    return Guarded(plan, out, reference.name, dataclasses.replace(report, escalated=True, spent_s=spent))
