"""Run a non-streamed answer on the work queue only while its client is still connected.

A client that times out and retries would otherwise leave its first request computing to
the end, so under load time-outs multiply the work. `answer_while_connected` watches the
connection while the job waits or runs; when the client disconnects it sets the job's cancel
flag: a job still queued is dropped before it starts (`WorkQueue.submit_cancellable`), one
that has retrieved but not prefilled stops there (`RagService.ask`), one that is decoding
stops at its next piece (`RagService.decode`). The handler then raises `ClientGone` (logged
as status 499, "client closed request"; nobody reads the answer).

Each abandoned request is counted once it has stopped, in
`kvmosaic_abandoned_requests_total{stage}`: `queued` (dropped before its prefill), `decoding`
(cancelled mid-answer) or `finished` (it ended before the flag was seen), and logged with
its stage and request id (`note_abandoned`, a WARNING).
Streamed answers use the same flag through `app.api.streaming.AnswerStream`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import Any

from fastapi import Request

from app.metrics import Metrics
from app.queue import Abandoned, WorkQueue
from app.rag import Answer, Query, RagService

log = logging.getLogger(__name__)

# What each stage of an abandoned request means, for its log line.
STAGE_WORDS = {
    "queued": "dropped before its prefill",
    "decoding": "cancelled while decoding",
    "finished": "it had finished first",
}


class ClientGone(Exception):
    """The client disconnected before its answer was ready; the work was cancelled."""


async def answer_while_connected(
    request: Request, queue: WorkQueue, rag: RagService, query: Query, metrics: Metrics
) -> Answer:
    """`rag.ask(query)` on the queue; raises ClientGone (after cancelling the job) if the
    client disconnects first, QueueFull as `WorkQueue.submit` does."""
    cancel = threading.Event()
    future = queue.submit_cancellable(cancel, rag.ask, query, None, cancel)
    job = asyncio.wrap_future(future)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    racing: set[asyncio.Future[Any]] = {job, watcher}  # the answer and the disconnect
    done, _ = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    if job in done:
        watcher.cancel()
        return job.result()
    cancel.set()
    job.add_done_callback(_outcome_read)
    # on the worker's thread when the job stops (the event loop may be gone by then)
    where = request_label(request)
    future.add_done_callback(lambda ended: note_abandoned(metrics, ended, where))
    raise ClientGone("the client disconnected; its request was cancelled")


def request_label(request: Request) -> str:
    """`<request id> (<method> <path>)`, how an abandoned request's log line names it."""
    rid = getattr(request.state, "request_id", "-")
    return f"{rid} ({request.method} {request.url.path})"


def note_abandoned(metrics: Metrics, ended: Future[Answer], request: str) -> None:
    """Log an abandoned job once it has stopped, with its stage and `request`
    (`request_label`), then count it: whoever sees the count can find the line."""
    stage = abandoned_stage(ended)
    log.warning(
        "request %s abandoned by its client: stage=%s (%s)", request, stage, STAGE_WORDS[stage]
    )
    metrics.abandoned.labels(stage).inc()


async def wait_for_disconnect(request: Request) -> None:
    """Return once the ASGI server reports that the client went away (the body has been read
    already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _outcome_read(job: asyncio.Future[Answer]) -> None:
    """Read the outcome of a job nobody awaits, so asyncio does not log its error as lost."""
    if not job.cancelled():
        job.exception()


def abandoned_stage(ended: asyncio.Future[Answer] | Future[Answer]) -> str:
    """Where an abandoned job stopped (see the module docstring)."""
    if ended.cancelled():
        return "queued"
    error = ended.exception()
    if isinstance(error, Abandoned):
        return "queued"
    if error is None and ended.result().finish_reason == "cancelled":
        return "decoding"
    return "finished"
