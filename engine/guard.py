"""The per-request fidelity guard: how far a reuse prefill may be from full prefill, and the fix.

A request names one of `FIDELITIES`:
- `exact`: the reference plan (full prefill), whatever the mode; the answer equals `full`'s.
- `fast`: the mode exactly as configured; its first-token margin is reported, nothing is spent.
- `balanced` (the default): the mode (blending at `guard_recompute_ratio` unless the request names a
  ratio: `default_ratio`), then two checks. A blended state goes wrong where the
  answer hangs on a near tie. At the first token (inside TTFT): when the log-probability
  margin of the top token over the runner-up is below `guard_margin` nats, the prompt is
  prefilled again as the reference plan would, and that result (equal to `full`'s to float
  tolerance) is what the request decodes. Like a repair, the re-run keeps the blended run's
  exact leading rows (the system prefix and the leading chunks exact in this context, such as
  the first chunk's base variant) as prefix caching would, and computes every later row. While decoding (`AnswerCheck`, after the first token has streamed): the
  first answer token within `guard_answer_tokens` whose margin is below
  `guard_answer_margin` stops the blended decode before that token is picked; the prompt
  plus the answer so far is prefilled by the reference plan (`repair`) and decoding goes on
  from that exact state, so the rest of the answer is what `full` would say after the same
  words. This costs no TTFT, only one full prefill for the requests that need it.

Why the margin and nothing else (SmolLM2, MuSiQue records 0-6, 3 chunks): the share of the
check layer's question-weighted deviation mass left on stale rows was 0.055-0.065 on every
record whatever its error, so it could not tell records apart, and keeping rows until that
mass was covered only raised the ratio uniformly; the blended first-token margin is low
exactly on the records whose first token or answer drifts. Against the other signals of the
blended logits alone (`python -m engine.bench.guard_signals`, records 0-47, 6 chunks of at most
256 tokens, cold cacheblend): entropy and top-1 probability rank the records by KL better
(Spearman 0.75 against the margin's 0.58), but at the re-run budgets the guard spends they
leave as much KL or more: re-running 10% of requests leaves mean KL 0.151 by margin, 0.207 by
entropy, 0.202 by top-1 probability (oracle 0.135); 25%: 0.119, 0.109, 0.111 (oracle 0.087),
because the margin alone catches the rare near-ties whose KL is largest. Re-measured with checks
1, 2, 6 at r = 0.13 (cold cacheblend@fast, the distinct chunk lists of workload traces 0, 24
and 48, 64 requests): entropy ranks by KL better (Spearman 0.73 against 0.60) and leaves less
KL at a 20-30% re-run budget (0.066 / 0.049 against 0.076 / 0.055), the same at 40% (0.038);
but on the reporting trace (MuSiQue 100-111, 23 lists) no signal of the blended logits ranks
KL at all (margin -0.02, entropy 0.24, top-1 probability 0.14): its blends are uniformly
worse (mean KL 0.155), so a better threshold cannot buy what a better blend would.
Measured once more on prompts shaped like the server's (MuSiQue 0-47, 6 chunks of at most 256
tokens, cold cachecraft at `fast`: mean KL 0.186; 0.144 once the margin re-runs its 19%),
with two second opinions added: the KL between the blend and a `naive` prefill (costs 25% of
a blend) and between the blend and one at r / 2 (70%). Spearman with KL: margin 0.49, entropy
0.69, top-1 probability 0.65, naive opinion 0.36, half-r opinion 0.58. Re-running 5 / 10 / 15%
more of the requests, most suspicious first, leaves KL 0.137 / 0.126 / 0.112 by margin, 0.129 /
0.121 / 0.074 by entropy, 0.097 / 0.085 / 0.072 by the half-r opinion, 0.087 / 0.072 / 0.053 by
the oracle; beyond ~15% more, the median TTFT falls under 3x full's. So on such prompts no
re-run signal reaches KL 0.05 at 3x; only a better blend (more rows: see `recompute_ratio`) can.
The guard works for every mode through the planner contract alone, never decodes, and never
makes a request less faithful than its mode.
"""

from __future__ import annotations

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
    # answer token index where decoding switched to the reference state (None: it never did),
    # that token's margin in the blended state, and the seconds of that prefill (after TTFT)
    repaired_at: int | None = None
    repair_margin: float | None = None
    repair_s: float = 0.0
    # the engine was busy and blends were mostly repaired: the first attempt was the exact-reuse
    # plan (`prefix`) instead of the mode's blend (engine/busy.py)
    skipped_blend: bool = False

    @property
    def estimate(self) -> str:
        """The guard's estimate against the floor, in one line for the request's report: where
        the first token's margin was measured, whether it reached the threshold calibrated so
        that a kept answer stays inside full prefill's own reorder floor (docs/benchmarks/fidelity.md)."""
        if self.skipped_blend:
            return "not judged: the engine was busy, so the context was computed exactly"
        if self.margin is None:
            return "exact state: nothing to judge" if self.fidelity != "exact" else "exact: full prefill"
        if self.fidelity == "fast" or self.threshold is None:
            return f"first-token margin {self.margin:.2f} nats, not judged (fast)"
        side = "inside" if self.margin >= self.threshold else "may leave"
        verdict = "re-ran in full" if self.escalated else "kept"
        if self.repaired_at is not None:
            verdict = f"kept, then repaired at answer token {self.repaired_at}"
        return (f"first-token margin {self.margin:.2f} nats against threshold {self.threshold:.2f}: "
                f"{side} full prefill's reorder floor; {verdict}")

    @property
    def outcome(self) -> str:
        """What answered, in one word (for dashboards): "skipped" (computed exactly at once, the
        engine busy), "rerun" (re-run in full at the first token), "repaired" (went on from full
        prefill while decoding), "exact" (an exact state: nothing to judge) or "kept" (the
        mode's own state answered, judged good enough or at `fast`)."""
        if self.skipped_blend:
            return "skipped"
        if self.escalated:
            return "rerun"
        if self.repaired_at is not None:
            return "repaired"
        return "exact" if self.margin is None else "kept"


def check_fidelity(fidelity: str | None, config: EngineConfig) -> str:
    """The request's level (config default when None); InvalidRequest if unknown."""
    fidelity = config.fidelity if fidelity is None else fidelity
    if fidelity not in FIDELITIES:
        raise InvalidRequest(f"unknown fidelity {fidelity!r}; known: {', '.join(FIDELITIES)}")
    return fidelity


def default_ratio(fidelity: str, config: EngineConfig) -> float:
    """The recompute ratio of a request that names none: `guard_recompute_ratio` for a
    `balanced` one (when set), else `recompute_ratio`."""
    if fidelity == "balanced" and config.guard_recompute_ratio is not None:
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


def judge(fidelity: str, config: EngineConfig, planner: BasePlanner, out: RunOutput, exact_state: bool) -> Verdict:
    """The verdict on `out`, the first attempt of `planner` at level `fidelity`.

    An exact plan (the reference, a fallback), an exact state (`exact_state`: every chunk from
    a float variant of this very context, such as `prefix`'s) and the `exact` level have
    nothing to judge (the report has no margin, and decoding is not watched). Otherwise the
    first token's margin is measured; `fast` only reports it, `balanced` asks for a re-run when
    `should_escalate`. Raises ValueError for an attempt run without logits.
    """
    if fidelity == "exact" or planner.exact or exact_state:
        return Verdict(GuardReport(fidelity), rerun=False)
    if out.logits is None:
        raise ValueError("the guard judges a prefill by its first token: run it with logits")
    margin = first_token_margin(out.logits)
    report = GuardReport(fidelity, margin, config.guard_margin)
    return Verdict(report, rerun=fidelity == "balanced" and should_escalate(margin, config))


class AnswerCheck:
    """The balanced guard's watch over decoding: `fired(step, logits)` is True at the first
    step in [1, window) whose top-token margin is below `threshold` nats (step 0, the first
    token, was judged at prefill). Once fired it stays silent; `fired_at` and `margin` say
    where and how low. One per request; called by the decoding thread only."""

    def __init__(self, threshold: float, window: int):
        self.threshold, self.window = threshold, window
        self.fired_at: int | None = None
        self.margin: float | None = None

    def fired(self, step: int, logits: torch.Tensor) -> bool:
        if self.fired_at is not None or not 1 <= step < self.window:
            return False
        margin = first_token_margin(logits)
        if margin >= self.threshold:
            return False
        self.fired_at, self.margin = step, margin
        return True


def answer_check(report: GuardReport, config: EngineConfig) -> AnswerCheck | None:
    """The check a decode runs under, or None: only `balanced` requests that decode from an
    inexact prefill of their mode are watched (the first-token check measured a margin and
    did not escalate); `exact`, `fast`, escalated and exact-plan prefills are not."""
    if report.fidelity != "balanced" or report.escalated or report.margin is None:
        return None
    if config.guard_answer_tokens <= 1:
        return None
    return AnswerCheck(config.guard_answer_margin, config.guard_answer_tokens)


def first_repair(margins: list[float], check: AnswerCheck) -> int | None:
    """Where `check` would fire along an answer whose per-step margins are `margins` (steps 0..),
    without firing it (teacher-forced figures follow the guard with this)."""
    return next((step for step, m in enumerate(margins) if 1 <= step < check.window and m < check.threshold), None)
