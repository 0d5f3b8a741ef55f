"""Carry an answer from its worker thread to the event loop as it is decoded.

`AnswerStream.start` submits the job at once, so a full queue raises `QueueFull` before the
response has started (the client gets a proper 503, not a broken stream). `events()` then
yields a `Piece` as each piece of text arrives and ends with `Done` (the Answer) or `Failed`
(the exception).
If the client goes away, closing the generator sets the cancel flag: a request still queued is
dropped unrun, one decoding stops at its next piece, freeing its slot.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from app.api.abandon import note_abandoned
from app.metrics import Metrics
from app.rag import Answer, Query
from app.services import Services

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class Piece:
    """The next piece of the answer's text."""

    text: str


@dataclass(frozen=True)
class Done:
    """The answer ended (the last event)."""

    answer: Answer


@dataclass(frozen=True)
class Failed:
    """The job raised (the last event)."""

    error: BaseException


StreamEvent = Piece | Done | Failed


class AnswerStream:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        metrics: Metrics | None = None,
        request: str = "-",
    ):
        """`metrics`: counts the answer as abandoned if its client left first; `request`:
        how its log line names the request (`app.api.abandon.request_label`)."""
        self._loop = loop
        self._items: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.cancel = threading.Event()
        self._metrics = metrics
        self._request = request

    @classmethod
    def start(cls, services: Services, query: Query, request: str = "-") -> AnswerStream:
        stream = cls(asyncio.get_running_loop(), services.metrics, request)
        future = services.queue.submit_cancellable(
            stream.cancel, services.rag.ask, query, stream._piece, stream.cancel
        )
        future.add_done_callback(stream._finished)
        return stream

    async def events(self) -> AsyncIterator[StreamEvent]:
        try:
            while True:
                event = await self._items.get()
                yield event
                if not isinstance(event, Piece):
                    return
        finally:
            self.cancel.set()

    def _piece(self, text: str) -> None:
        self._post(Piece(text))

    def _finished(self, future: Future[Answer]) -> None:
        if self.cancel.is_set() and self._metrics is not None:  # the client left before the end
            note_abandoned(self._metrics, future, self._request)
        error = future.exception()
        self._post(Failed(error) if error is not None else Done(future.result()))

    def _post(self, item: StreamEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop has closed (server shutting down): nobody is listening
            pass


def sse(data: str | Mapping[str, object], event: str | None = None) -> str:
    """One Server-Sent Events frame; `data` is JSON-encoded unless it is a str."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"
