"""The per-request fidelity guard: how far a reuse prefill may be from full prefill, and the fix.

A request names one of `FIDELITIES`:
- `exact`: the reference plan (full prefill), whatever the mode; the answer equals `full`'s.
- `fast`: the mode exactly as configured; its first-token margin is reported, nothing is spent.
- `balanced` (the default): the mode, then a check at the first token. A blended state goes
  wrong where the answer hangs on a near tie: when the log-probability margin of the top
  token over the runner-up is below `guard_margin` nats, the prompt is prefilled again by the
  reference plan, and that result (equal to `full`'s) is what the request decodes.

Why the margin and nothing else (SmolLM2, MuSiQue records 0-6, 3 chunks): the share of the
check layer's question-weighted deviation mass left on stale rows was 0.055-0.065 on every
record whatever its error, so it could not tell records apart, and keeping rows until that
mass was covered only raised the ratio uniformly; the blended first-token margin is low
exactly on the records whose first token or answer drifts. The guard works for every mode
through the planner contract alone, never decodes, and never makes a request less faithful
than its mode.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.config import FIDELITIES, EngineConfig
from engine.errors import InvalidRequest

if TYPE_CHECKING:
    from engine.planners.base import BasePlanner
    from engine.plan import Plan
    from engine.runner import RunOutput


@dataclass(frozen=True)
class GuardReport:
    """What the guard estimated and spent for one request.

    margin: log-probability margin (nats) of the first attempt's top token over the
    runner-up (None when the plan was the reference itself); threshold: the margin below which
    `balanced` escalates; escalated: the answer comes from a second, full prefill; spent_s:
    seconds of that second prefill (0 when none), already inside the result's TTFT.
    """

    fidelity: str
    margin: float | None = None
    threshold: float | None = None
    escalated: bool = False
    spent_s: float = 0.0


def check_fidelity(fidelity: str | None, config: EngineConfig) -> str:
    """The request's level (config default when None); InvalidRequest if unknown."""
    fidelity = config.fidelity if fidelity is None else fidelity
    if fidelity not in FIDELITIES:
        raise InvalidRequest(f"unknown fidelity {fidelity!r}; known: {', '.join(FIDELITIES)}")
    return fidelity


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

    plan: Plan
    out: RunOutput
    planner_name: str
    report: GuardReport


def run_guarded(fidelity: str, config: EngineConfig, run: Callable[[BasePlanner], tuple[Plan, RunOutput]],
                planner: BasePlanner, reference: BasePlanner) -> Guarded:
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
    if out.logits is None:
        raise ValueError("the guard judges a prefill by its first token: run it with logits")
    margin = first_token_margin(out.logits)
    report = GuardReport(fidelity, margin, config.guard_margin)
    if fidelity == "fast" or not should_escalate(margin, config):
        return Guarded(plan, out, planner.name, report)
    started = time.perf_counter()
    plan, out = run(reference)
    spent = time.perf_counter() - started
    return Guarded(plan, out, reference.name, dataclasses.replace(report, escalated=True, spent_s=spent))
