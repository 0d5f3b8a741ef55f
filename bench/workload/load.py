"""Load generators: closed-loop clients or open-loop arrivals, through the server's work queue.

Each request goes exactly where an HTTP `/ask` goes: `services.queue` (the server's worker
threads, its bounded waiting line and its 503 rule) running `services.rag.ask`. Times are
taken as a client sees them: TTFT from submission to the first answer piece (queue wait,
retrieval, KV loads and prefill included), latency from submission to the whole answer.

`digest(outcome, answer)` turns each answer into what the caller keeps, as soon as it is
done: an answer holds its prompt's whole KV, too much to keep for a long trace.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from app.queue import QueueFull
from engine.serving.threads import single_threaded


@dataclass
class Outcome:
    """One request of the trace as the client saw it; `error` is "rejected" for a 503."""

    index: int
    submitted: float
    first_piece: float | None = None
    last_piece: float | None = None
    finished: float | None = None
    answer: object | None = None  # what `digest` made of the app.rag.Answer
    error: str | None = None
    rejections: int = 0

    @property
    def ok(self) -> bool:
        return self.answer is not None

    def piece(self, _text: str) -> None:
        self.last_piece = time.perf_counter()
        if self.first_piece is None:
            self.first_piece = self.last_piece


Digest = Callable[[Outcome, object], object]


def _keep_answer(_outcome: Outcome, answer: object) -> object:
    return answer


def run_closed_loop(
    services, queries: Sequence, clients: int, deadline: float, digest: Digest = _keep_answer
) -> list[Outcome]:
    """`clients` threads, each sending its next request when the last one is answered, until the
    trace is done or `deadline` (perf_counter) has passed. A 503 is retried after a short wait."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    order = iter(range(len(queries)))

    def client() -> None:
        # its fidelity arithmetic must not form a pool (engine/serving/threads.py)
        single_threaded()
        while time.perf_counter() < deadline:
            with lock:
                index = next(order, None)
            if index is None:
                return
            outcome = _ask_until_served(services, queries[index], index, deadline, digest)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, name=f"bench-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(outcomes, key=lambda o: o.index)


def _ask_until_served(services, query, index: int, deadline: float, digest: Digest) -> Outcome:
    outcome = Outcome(index, time.perf_counter())
    while True:
        try:
            future = services.queue.submit(services.rag.ask, query, outcome.piece)
            break
        except QueueFull:
            outcome.rejections += 1
            if time.perf_counter() > deadline:
                outcome.error = "rejected"
                return outcome
            time.sleep(0.05)
    _settle(outcome, future, digest)
    return outcome


def run_open_loop(
    services,
    queries: Sequence,
    rate: float,
    deadline: float,
    seed: int = 0,
    digest: Digest = _keep_answer,
) -> list[Outcome]:
    """Poisson arrivals at `rate` requests/s, whatever the server's state; a full queue is a 503,
    not retried (`error="rejected"`). Waits for every accepted request to finish."""
    rng = random.Random(seed)
    outcomes, settled = [], []
    next_arrival = time.perf_counter()
    for index, query in enumerate(queries):
        next_arrival += rng.expovariate(rate)
        if next_arrival > deadline:
            break
        time.sleep(max(0.0, next_arrival - time.perf_counter()))
        outcome = Outcome(index, time.perf_counter())
        outcomes.append(outcome)
        try:
            future = services.queue.submit(services.rag.ask, query, outcome.piece)
        except QueueFull:
            outcome.error, outcome.rejections = "rejected", 1
            continue
        done = threading.Event()
        settled.append(done)
        # settled on the worker as it finishes, so `finished` is when the answer was complete
        future.add_done_callback(lambda f, o=outcome, d=done: (_settle(o, f, digest), d.set()))
    for done in settled:
        done.wait()
    return outcomes


def _settle(outcome: Outcome, future: Future, digest: Digest) -> None:
    try:
        answer = future.result()
    except Exception as exc:  # a failed request is a figure of the run, not the end of it
        outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.finished = time.perf_counter()
        return
    outcome.finished = time.perf_counter()
    outcome.answer = digest(outcome, answer)
