"""A request under the fidelity guard, from its first attempt to its last answer token.

`GuardedRequest` is the guard's side of one request (guard.py says what the levels promise):
`prefill`, on the compute thread, runs first attempt → judge → (re-run) and returns the run the
request keeps; `watch` says what its decode is watched for; `answer`, on the thread that reads
the answer, runs decode → (repair) and carries its `Repair` record in the answer's stream.
Between the two halves the request's state is its frozen `PrefillResult` (its watch and the
exact rows a repair keeps): a caller may decode a prefill later, or never (teacher forcing).

The engine provides the model work (its runner, `compute`, `decode_ids`); this module decides
what runs. The decode's checks come back as decisions: the margin check's verdict through the
decode stream's end (`engine.model.decode.ended_by`, made on the scheduler's thread and handed
over by its queue), the grounding check's `Release` on this thread (grounding.py). Tokens the
grounding check holds back are never sent before the decode that picked them is judged: when
either check stops it, the repair starts at the first token not sent (a held span is decided
again by the exact state).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import closing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from engine.kv import ChunkKV, KVCache
from engine.model.decode import SamplingParams, TokenIds, ended_by, new_generator
from engine.plan import CachedSpan, Plan, PlanRequest
from engine.planners import exact_reuse_planner, reference_planner
from engine.planners.focus import focus_mask, wants_focus
from engine.prompt import PromptLayout
from engine.serving.grounding import AnswerGrounding, Release, Sources
from engine.serving.guard import (
    AnswerWatch,
    Guarded,
    GuardReport,
    RepairReason,
    answer_watch,
    judge,
)
from engine.serving.repair import AnswerIds, Repair

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.model.decode import StepCheck
    from engine.model.loader import LoadedModel
    from engine.model.runner import LayerRunner, RunOutput
    from engine.planners.base import BasePlanner
    from engine.prompt import PromptBuilder
    from engine.result import PrefillResult
    from engine.serving.busy import BusyGate
    from engine.serving.profile import ReuseProfile

T = TypeVar("T")


class GuardedEngine(Protocol):
    """What a guarded request needs of the engine (`engine.engine.Engine` is one): its runner
    and compute thread, the busy gate, the reuse profile, the prompt builder and the decode."""

    busy: BusyGate
    loaded: LoadedModel
    profile: ReuseProfile
    prompts: PromptBuilder
    runner: LayerRunner

    @property
    def device(self) -> torch.device: ...

    @property
    def fingerprint(self) -> str: ...

    def compute(self, fn: Callable[[], T]) -> T: ...

    def num_decoding(self) -> int: ...

    def decode_ids(
        self,
        cache: KVCache,
        logits: torch.Tensor,
        params: SamplingParams,
        check: StepCheck | None,
        generator: torch.Generator | None,
    ) -> TokenIds: ...


@dataclass(frozen=True)
class Stop:
    """Why the blended decode stopped before answer token `at` (the ids before it sent): a low
    margin (`margin`; `span`, if any, the text held back then, never sent) or an ungrounded
    `span` (grounding.py)."""

    answered: tuple[int, ...]
    margin: float | None = None
    span: str | None = None

    @property
    def at(self) -> int:
        return len(self.answered)

    @property
    def reason(self) -> RepairReason:
        return "margin" if self.margin is not None else "grounding"


class GuardedRequest:
    """The guard's side of one request (module docstring); `engine` does the model work."""

    def __init__(self, engine: GuardedEngine):
        self.engine = engine

    # -- prefill: first attempt → judge → (re-run), on the compute thread ----------------------

    def prefill(self, request: PlanRequest, planner: BasePlanner, capacity: int) -> Guarded:
        """The run the request keeps: its first attempt's, or the exact re-run's when the
        guard's verdict asks for one (inside TTFT)."""
        first, skipped = self.first_attempt(request, planner)
        if first.blends() and wants_focus(request):  # the rows the question reads, recomputed
            request = replace(request, focus=focus_mask(self.engine.runner, request))
        plan, out = self._run(request, capacity, first)
        exact = all(request.exact_chunks(out.layers_computed))
        verdict = judge(request.fidelity, request.config, first, out, exact)
        if not verdict.rerun:
            report = replace(
                verdict.report, skipped_blend=skipped == "busy", exact_first=skipped == "profile"
            )
            return Guarded(plan, out, first.name, report)
        started = time.perf_counter()
        rows = exact_leading_rows(request.layout, request.exact_chunks(out.layers_computed))
        plan, out = self.exact_prefill(request.layout, out.cache, rows, capacity)
        report = replace(verdict.report, escalated=True, spent_s=time.perf_counter() - started)
        return Guarded(plan, out, reference_planner(request.config).name, report)

    def first_attempt(
        self, request: PlanRequest, planner: BasePlanner
    ) -> tuple[BasePlanner, str | None]:
        """The first attempt's planner and why it skipped the mode's blend (None: it did not):
        the reference for a level that runs it (`exact`); the exact-reuse plan for a guarded
        blend that the model's reuse profile has not passed ("profile": exact-first,
        engine/serving/profile.py) or that the busy engine would only have to repair anyway
        ("busy": engine/serving/busy.py); else the mode's own."""
        config, engine = request.config, self.engine
        if request.fidelity.runs_reference:
            return reference_planner(config), None
        blends = (
            request.fidelity.guards and planner.blends() and not all(request.exact_chunks(None))
        )  # every chunk from a variant of this context: no blend
        if not blends:
            return planner, None
        if config.reuse_profile == "auto" and not engine.profile.allows(
            request.fidelity, planner.name
        ):
            return exact_reuse_planner(config), "profile"
        if engine.busy.skip_blend(config.guard_busy_repair_share, engine.num_decoding()):
            return exact_reuse_planner(config), "busy"
        return planner, None

    def watch(self, request: PlanRequest, kept: Guarded) -> tuple[AnswerWatch | None, int | None]:
        """What the kept run's decode is watched for (None: nothing) and the exact rows a
        repair keeps; a judged blend that is not watched has its outcome now, for the busy
        gate's odds."""
        watch = answer_watch(kept.report, request.config)
        if watch is not None:
            exact = request.exact_chunks(kept.out.layers_computed)
            return watch, exact_leading_rows(request.layout, exact)
        if _judged_blend(kept.report):
            self.engine.busy.odds.record(kept.report.escalated, at_first_token=True)
        return None, None

    def _run(
        self, request: PlanRequest, capacity: int, planner: BasePlanner
    ) -> tuple[Plan, RunOutput]:
        """Plan the request with `planner` and run its layers (synchronised: timings are real)."""
        engine = self.engine
        plan = planner.plan(request)
        out = engine.runner.run(
            request.layout.token_tensor(engine.device),
            plan,
            capacity=capacity,
            reading=request.reading,
        )
        _synchronize(engine.device)
        return plan, out

    def exact_prefill(
        self, layout: PromptLayout, cache: KVCache, exact_rows: int, capacity: int
    ) -> tuple[Plan, RunOutput]:
        """Prefill `layout` as the reference would, into a new cache of `capacity` rows.

        Rows [0, exact_rows) of the blended `cache` (the system prefix and the leading chunks
        that were exact in this context) are reused as prefix caching would; every row after
        them is computed through every layer, so the result is what `full` computes, to float
        tolerance. `cache` is not modified; the caller holds the prefill turn."""
        engine, total = self.engine, layout.total_len
        exact = ChunkKV(
            token_ids=tuple(layout.token_tensor().tolist()[:exact_rows]),
            kv=cache.data[:, :, :, :exact_rows],
            base_position=0,
            fingerprint=engine.fingerprint,
            prefix_digest=engine.prompts.prefix_digest,
        )
        plan = Plan(
            [CachedSpan(0, exact)] if exact_rows else [],
            torch.arange(exact_rows, total),
            pinned=torch.ones(total, dtype=torch.bool),
        )
        out = engine.runner.run(layout.token_tensor(engine.device), plan, capacity=capacity)
        _synchronize(engine.device)
        return plan, out

    # -- answer: decode → (repair), on the thread that reads it --------------------------------

    def answer(
        self, result: PrefillResult, params: SamplingParams, generator: torch.Generator | None
    ) -> AnswerIds:
        """The answer's token ids, and its `Repair` where the watch stopped the blended decode
        (the rest decoded from the exact state of the prompt and the answer so far). The
        request joins the decode batch at once; closing the stream closes whichever decode is
        under way: cancellation holds."""
        blended = self.engine.decode_ids(
            result.cache, result.logits, params, result.watch, generator
        )
        return self._answered(result, blended, params, generator)

    def _answered(
        self,
        result: PrefillResult,
        blended: TokenIds,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> AnswerIds:
        engine, watch = self.engine, result.watch
        if watch is None:
            with closing(blended):
                yield from blended
            return
        grounding = self._grounding(result) if watch.grounding else None
        with closing(blended):
            stop = yield from _watched(blended, grounding)
        engine.busy.odds.record(stop is not None)  # reached only when the blended decode ended
        if stop is None:
            return
        started = time.perf_counter()
        out = self._repair(result, stop.answered)
        if out.logits is None:
            raise RuntimeError("a repair ran without logits")
        seconds = time.perf_counter() - started
        yield Repair(
            stop.at, stop.margin, seconds, out.cache, out.layers_computed, stop.reason, stop.span
        )
        rest = replace(params, max_new_tokens=params.max_new_tokens - stop.at)
        if stop.margin is None:  # the blended decode drew ahead of the held span, by timing
            generator = new_generator(_tail_seed(params.seed, stop.at), out.logits.device)
        with closing(engine.decode_ids(out.cache, out.logits, rest, None, generator)) as tail:
            yield from tail

    def _grounding(self, result: PrefillResult) -> AnswerGrounding:
        """The answer's grounding in the prompt's text after the system prefix: the passages,
        their titles and the question (the chat template's markers are special tokens, left
        out)."""
        tokenizer = self.engine.loaded.tokenizer
        ids = result.layout.token_tensor().tolist()[result.layout.prefix_len :]
        return AnswerGrounding(
            tokenizer, Sources(str(tokenizer.decode(ids, skip_special_tokens=True)))
        )

    def _repair(self, result: PrefillResult, answered: tuple[int, ...]) -> RunOutput:
        """The exact state of the prompt followed by `answered` in a new cache of the same
        capacity, and the next token's logits (see `exact_prefill`)."""
        layout = replace(result.layout, question_ids=result.layout.question_ids + answered)
        cache, rows = result.cache, result.exact_rows
        assert rows is not None  # set with every watch
        with self.engine.busy.in_flight():
            return self.engine.compute(
                lambda: self.exact_prefill(layout, cache, rows, cache.capacity)[1]
            )


def _watched(
    blended: TokenIds, grounding: AnswerGrounding | None
) -> Generator[int, None, Stop | None]:
    """`blended`'s ids as the watch releases them, then why it stopped the decode (None: it
    did not). Without `grounding` every id goes out as it comes."""
    answered: list[int] = []
    while True:
        try:
            token = next(blended)
        except StopIteration as end:
            fired = ended_by(end)
            break
        answered.append(token)
        if grounding is None:
            yield token
            continue
        release = grounding.push(token)
        yield from release.tokens
        if release.ungrounded is not None:
            return _grounding_stop(grounding, release)
    if fired is not None:  # a held span is left to the exact state too: the repair starts there
        if grounding is None:
            return Stop(tuple(answered), fired.margin)
        held = grounding.held_text().strip() or None
        return Stop(tuple(grounding.ids[: grounding.released]), fired.margin, held)
    if grounding is None:
        return None
    release = grounding.end()
    yield from release.tokens
    return None if release.ungrounded is None else _grounding_stop(grounding, release)


def _grounding_stop(grounding: AnswerGrounding, release: Release) -> Stop:
    assert release.ungrounded is not None
    return Stop(tuple(grounding.ids[: grounding.released]), span=release.ungrounded.text)


def _tail_seed(seed: int | None, at: int) -> int | None:
    """The seed of the answer's tail after a grounding repair at token `at`: a seeded sample
    stays repeatable although the blended decode drew a number of tokens ahead that depends on
    timing (a margin repair stops before its token is drawn, and goes on with the same
    generator)."""
    return None if seed is None else (seed * 1_000_003 + at) % 2**63


def _judged_blend(report: GuardReport) -> bool:
    """Whether a guarded first attempt blended and was judged at its first token (a margin
    measured), so its outcome is known at prefill: re-run, or kept with no watch while decoding."""
    return report.fidelity.guards and report.margin is not None and not report.skipped_blend


def exact_leading_rows(layout: PromptLayout, exact_chunks: list[bool] | tuple[bool, ...]) -> int:
    """Rows of the prompt that are exact before the first inexact chunk (the system prefix,
    which reuse modes always take from its exact cache, and the exact leading chunks)."""
    leading = next(
        (i for i, is_exact in enumerate(exact_chunks) if not is_exact), len(exact_chunks)
    )
    return layout.chunk_spans[leading - 1][1] if leading else layout.prefix_len


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
