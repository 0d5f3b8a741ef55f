"""The per-request fidelity guard: how far a reuse prefill may be from full prefill, and the fix.

A request names one of `FIDELITIES`:
- `exact`: the reference plan (full prefill), whatever the mode; the answer equals `full`'s.
- `fast`: the mode exactly as configured; its first-token margin is reported, nothing is spent.
- `balanced` (the default): the mode (blending at `guard_recompute_ratio` unless the request
  names a ratio: `default_ratio`), then two checks of the log-probability margin of the top
  token over the runner-up. At the first token (inside TTFT), a margin below `guard_margin`
  nats re-runs the prompt as the reference would (`judge` returns the `Verdict`; the engine
  keeps the blend's exact leading rows and computes every later row). While decoding
  (`AnswerWatch`), the first answer token within `guard_answer_tokens` whose margin is below
  `guard_answer_margin` stops the blended decode before that token is picked, and so does a
  number, date or name that no passage nor the question contains (`guard_grounding`,
  grounding.py), before its first token is sent (it cannot see a wrong value that some passage
  does contain: a neighbouring passage's year or name); the prompt and the answer so far are
  prefilled as the reference would and decoding goes on from that exact state, so the rest of
  the answer is what `full` says after the same words. guarded.py runs these steps for a
  request; this module judges and reports.

Contract: `exact` is token-identical to `full`; `balanced` keeps task accuracy within full's
95% interval and its deviation from `full` inside full prefill's own stability floor (the
deviation full shows against itself when the same chunks come in another order); `fast`
promises speed and reports its deviation. The thresholds are calibrated on answerable cases
against that floor, on seeds kept apart from the reports: docs/benchmarks/fidelity.md.
Why the margin: a blended state goes wrong where the answer hangs on a near tie, and that is
also where full prefill itself flips when the chunk order changes. The guard works for every
mode through the planner contract alone, never decodes, and never makes a request less
faithful than its mode.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from engine.config import EngineConfig, Fidelity
from engine.model.decode import Fired

if TYPE_CHECKING:
    from engine.model.runner import RunOutput
    from engine.plan import Plan
    from engine.planners.base import BasePlanner


# why a decode was repaired: a low top-token margin, or a span no source holds (grounding.py)
RepairReason = Literal["margin", "grounding"]


@dataclass(frozen=True)
class GuardReport:
    """What the guard estimated and spent for one request.

    margin: log-probability margin (nats) of the first attempt's top token over the
    runner-up (None when the plan was the reference itself); threshold: the margin below which
    `balanced` escalates; escalated: the answer comes from a second, full prefill; spent_s:
    seconds of that second prefill (0 when none), already inside the result's TTFT.
    """

    fidelity: Fidelity
    margin: float | None = None
    threshold: float | None = None
    escalated: bool = False
    spent_s: float = 0.0
    # answer token index where decoding switched to the reference state (None: it never did),
    # the margin that stopped the blended decode (None: not measured, a grounding repair), the
    # seconds of that prefill (after TTFT), why ("margin" or "grounding") and the span: for
    # grounding, the answer's span that no passage nor the question contains; for a margin, the
    # text held back when it fell (the repair started there; None: nothing was held)
    repaired_at: int | None = None
    repair_margin: float | None = None
    repair_s: float = 0.0
    repair_reason: RepairReason | None = None
    repair_span: str | None = None
    # the engine was busy and blends were mostly repaired: the first attempt was the exact-reuse
    # plan (`prefix`) instead of the mode's blend (engine/serving/busy.py)
    skipped_blend: bool = False
    # the model's reuse profile passed no blend of this mode at this level: the first attempt
    # was the exact-reuse plan (exact-first, engine/serving/profile.py)
    exact_first: bool = False

    @property
    def estimate(self) -> str:
        """The guard's estimate against the floor, in one line for the request's report: where
        the first token's margin was measured, whether it reached the threshold calibrated so
        that a kept answer stays inside full prefill's own reorder floor
        (docs/benchmarks/fidelity.md)."""
        if self.exact_first:
            return (
                "not judged: no blend of this mode is measured to hold on this model (its reuse "
                "profile), so the context was computed exactly after its exact chunks"
            )
        if self.skipped_blend:
            return "not judged: the engine was busy, so the context was computed exactly"
        if self.margin is None:
            return (
                "exact: full prefill"
                if self.fidelity.runs_reference
                else "exact state: nothing to judge"
            )
        if not self.fidelity.guards or self.threshold is None:
            return f"first-token margin {self.margin:.2f} nats, not judged (fast)"
        side = "inside" if self.margin >= self.threshold else "may leave"
        verdict = "re-ran in full" if self.escalated else "kept"
        if self.repaired_at is not None:
            verdict = f"kept, then repaired at answer token {self.repaired_at}"
            if self.repair_reason == "grounding":
                verdict += f": {self.repair_span!r} is in no passage"
            elif self.repair_span is not None:
                verdict += f" (a low margin while {self.repair_span!r} was held back, unsent)"
        return (
            f"first-token margin {self.margin:.2f} nats against threshold {self.threshold:.2f}: "
            f"{side} full prefill's reorder floor; {verdict}"
        )

    @property
    def outcome(self) -> str:
        """What answered, in one word (for dashboards): "exact-first" (computed exactly at
        once: the model's reuse profile passed no blend), "skipped" (the same, the engine busy),
        "rerun" (re-run in full at the first token), "repaired" (went on from full prefill while
        decoding), "exact" (an exact state: nothing to judge) or "kept" (the mode's own state
        answered, judged good enough or at `fast`)."""
        if self.exact_first:
            return "exact-first"
        if self.skipped_blend:
            return "skipped"
        if self.escalated:
            return "rerun"
        if self.repaired_at is not None:
            return "repaired"
        return "exact" if self.margin is None else "kept"

    def repaired(
        self,
        at: int,
        margin: float | None,
        seconds: float,
        reason: RepairReason = "margin",
        span: str | None = None,
    ) -> GuardReport:
        """This report with the repair made while decoding (a new record; this one stays)."""
        return replace(
            self,
            repaired_at=at,
            repair_margin=margin,
            repair_s=seconds,
            repair_reason=reason,
            repair_span=span,
        )


def default_ratio(fidelity: Fidelity, config: EngineConfig) -> float:
    """The recompute ratio of a request that names none: `guard_recompute_ratio` for a
    guarded (`balanced`) one when set, else `recompute_ratio`."""
    if fidelity.guards and config.guard_recompute_ratio is not None:
        return config.guard_recompute_ratio
    return config.recompute_ratio


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


class Verdict(NamedTuple):
    """The guard's decision on a first attempt: what it estimated, and whether the request
    must be re-run as the reference would compute it (inside TTFT)."""

    report: GuardReport
    rerun: bool


def judge(
    fidelity: Fidelity,
    config: EngineConfig,
    planner: BasePlanner,
    out: RunOutput,
    exact_state: bool,
) -> Verdict:
    """The verdict on `out`, the first attempt of `planner` at level `fidelity`.

    An exact plan (the reference, a fallback), an exact state (`exact_state`: every chunk from
    a float variant of this very context, such as `prefix`'s) and the `exact` level have
    nothing to judge (the report has no margin, and decoding is not watched). Otherwise the
    first token's margin is measured; `fast` only reports it, `balanced` asks for a re-run when
    `should_escalate`. Raises ValueError for an attempt run without logits.
    """
    if fidelity.runs_reference or planner.exact or exact_state:
        return Verdict(GuardReport(fidelity), rerun=False)
    if out.logits is None:
        raise ValueError("the guard judges a prefill by its first token: run it with logits")
    margin = first_token_margin(out.logits)
    report = GuardReport(fidelity, margin, config.guard_margin)
    return Verdict(report, rerun=fidelity.guards and should_escalate(margin, config))


@dataclass(frozen=True)
class AnswerWatch:
    """What the balanced guard watches while a request decodes: answer steps in [1, `window`)
    whose top-token margin is below `threshold` nats (step 0, the first token, was judged at
    prefill), and, when `grounding`, numbers, dates and names of the answer that no passage
    nor the question contains (engine/serving/grounding.py).

    Immutable: `fired` is a pure function of its arguments, so the decoding thread (the
    scheduler's, in a batch) may call it while the request's own thread holds the watch; the
    verdict comes back through the decode stream's end (`engine.model.decode.ended_by`)."""

    threshold: float
    window: int
    grounding: bool = False

    def fired(self, step: int, logits: torch.Tensor) -> Fired | None:
        """The verdict at answer step `step` before its token is picked (None: go on)."""
        if not 1 <= step < self.window:
            return None
        margin = first_token_margin(logits)
        return Fired(step, margin) if margin < self.threshold else None


def answer_watch(report: GuardReport, config: EngineConfig) -> AnswerWatch | None:
    """What a decode is watched for, or None: only guarded (`balanced`) requests that decode
    from an inexact prefill of their mode are watched (the first-token check measured a margin
    and did not escalate); `exact`, `fast`, escalated and exact-plan prefills are not."""
    if not report.fidelity.guards or report.escalated or report.margin is None:
        return None
    if config.guard_answer_tokens <= 1:
        return None
    return AnswerWatch(
        config.guard_answer_margin, config.guard_answer_tokens, config.guard_grounding
    )


def first_repair(margins: list[float], check: AnswerWatch) -> int | None:
    """Where a check of `check` would fire along an answer whose per-step margins are `margins`
    (steps 0..) (teacher-forced figures follow the guard with this)."""
    return next(
        (
            step
            for step, m in enumerate(margins)
            if 1 <= step < check.window and m < check.threshold
        ),
        None,
    )
