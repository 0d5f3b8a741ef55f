"""Helpers for batching tests: four requests decoded alone, or joining one decode batch mid-way."""

from __future__ import annotations

from engine.model.decode import SamplingParams
from engine.planners import Mode
from tests.engine.helpers import QUESTION, answer_ids

QUESTIONS = [QUESTION, "Where does the Danube flow?", "What is green tea?", "How warm is a hive?"]
BUDGETS = [14, 6, 10, 3]  # requests leave the batch at different steps


def prefill(engine, chunks, i, mode):
    return engine.prefill(
        chunks[i % 2 :], QUESTIONS[i], mode=Mode.named(mode), max_new_tokens=BUDGETS[i]
    )


def decode_alone(engine, chunks, mode, params=None):
    tokens = []
    for i in range(len(QUESTIONS)):
        result = prefill(engine, chunks, i, mode)
        tokens.append(
            answer_ids(engine, result, params or SamplingParams(max_new_tokens=BUDGETS[i]))
        )
    return tokens


class StepRecorder:
    """Stands in for `decode_batch` in the scheduler: records each step's batch size and runs
    `actions[n]` on the scheduler thread just before the n-th step (0-based), so joins and
    cancellations land between known steps."""

    def __init__(self, real):
        self.real, self.sizes, self.actions = real, [], {}

    def __call__(self, stack, caches, tokens, **options):
        action = self.actions.pop(len(self.sizes), None)
        if action is not None:
            action()
        self.sizes.append(len(caches))
        return self.real(stack, caches, tokens, **options)


def decode_joined(
    engine, chunks, mode, steps: StepRecorder, params=None, cancel: int | None = None
):
    """Request 0 decodes alone for three steps; then 1-3 join together; 3 leaves first (budget 3).

    `cancel`: that request is cancelled right after the first joint step. Returns every
    request's generated ids.
    """
    results = [prefill(engine, chunks, i, mode) for i in range(len(QUESTIONS))]
    streams = {}

    def start(i):
        streams[i] = engine.generate(
            results[i], params or SamplingParams(max_new_tokens=BUDGETS[i])
        )

    base = len(steps.sizes)
    steps.actions[base + 2] = lambda: [start(i) for i in range(1, len(QUESTIONS))]
    if cancel is not None:
        steps.actions[base + 3] = lambda: streams[cancel].close()
    start(0)
    list(streams[0])
    join = steps.actions.pop(base + 2, None)
    if join is not None:  # request 0 stopped (EOS) before the join: the others start together now
        join()
    for i in range(1, len(QUESTIONS)):
        list(streams[i])
    return [list(streams[i].decoded().token_ids) for i in range(len(QUESTIONS))]
