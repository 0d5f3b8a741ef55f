"""OpenAI-compatible `POST /v1/chat/completions` and `GET /v1/models`.

The last user message is the question; retrieval adds the context. Streaming follows the
OpenAI wire format (`chat.completion.chunk` frames, then `data: [DONE]`), so the official
`openai` client works unchanged against this server. The token budget may come as
`max_tokens` (OpenAI's older name) or `max_completion_tokens`: each one sent is held to the
server's limit, and with both the smaller applies (`token_budget`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypedDict

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from app.api.abandon import answer_while_connected, request_label
from app.api.deps import ServicesDep
from app.api.errors import documented, error_body
from app.api.streaming import SSE_HEADERS, AnswerStream, Done, Piece, sse
from app.rag import Answer
from app.report import ask_response
from app.schemas.chat import (
    TOKEN_BUDGET_FIELDS,
    AssistantMessage,
    ChatRequest,
    ChatResponse,
    ChatUsage,
    Choice,
    ModelCard,
    ModelList,
)
from engine.errors import InvalidRequest

router = APIRouter(prefix="/v1", tags=["openai"])

STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "with stream=true: `chat.completion.chunk` frames, then `data: [DONE]`",
    }
}


class Head(TypedDict):
    """What the response, or every chunk of the stream, of one completion starts with."""

    id: str
    created: int
    model: str


@router.get("/models", response_model=ModelList)
def models(services: ServicesDep) -> ModelList:
    return ModelList(data=[ModelCard(id=services.model_name, created=int(services.started_at))])


@router.post(
    "/chat/completions",
    response_model=ChatResponse,
    responses={**STREAM_DOC, **documented(400, 422, 503)},
)
async def chat_completions(
    body: ChatRequest, services: ServicesDep, request: Request
) -> ChatResponse | StreamingResponse:
    query = services.rag.query(
        question=body.question(),
        top_k=body.top_k,
        mode=body.mode,
        ratio=body.ratio,
        max_tokens=token_budget(body, services.settings.max_tokens_limit),
        temperature=body.temperature or 0.0,
        top_p=body.top_p or 1.0,
        seed=body.seed,
        fidelity=body.fidelity,
        packets=body.packets,
        conditioned=body.conditioned,
        ape=body.ape,
    )
    head: Head = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": services.model_name,
    }
    if not body.stream:
        answer = await answer_while_connected(
            request, services.queue, services.rag, query, services.metrics
        )
        return ChatResponse(
            **head,
            choices=[
                Choice(
                    message=AssistantMessage(content=answer.text),
                    finish_reason=finish_reason(answer.finish_reason),
                )
            ],
            usage=chat_usage(answer),
            kvmosaic=ask_response(answer).model_dump(mode="json"),
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(
        chunk_frames(
            AnswerStream.start(services, query, request_label(request)), head, include_usage
        ),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


def token_budget(body: ChatRequest, limit: int) -> int | None:
    """The answer's token budget (None: the server's default): every budget field the client
    sent must be within `limit` (else 422, naming the field); with both, the smaller wins."""
    sent: dict[str, int | None] = {name: getattr(body, name) for name in TOKEN_BUDGET_FIELDS}
    budgets = {name: value for name, value in sent.items() if value is not None}
    for name, value in budgets.items():
        if value > limit:
            raise InvalidRequest(f"{name} is {value}; the limit is {limit}")
    return min(budgets.values(), default=None)


async def chunk_frames(stream: AnswerStream, head: Head, include_usage: bool) -> AsyncIterator[str]:
    chunk = {**head, "object": "chat.completion.chunk"}
    yield sse({**chunk, "choices": [_delta({"role": "assistant", "content": ""})]})
    async for event in stream.events():
        if isinstance(event, Piece):
            yield sse({**chunk, "choices": [_delta({"content": event.text})]})
        elif isinstance(event, Done):
            reason = finish_reason(event.answer.finish_reason)
            yield sse({**chunk, "choices": [_delta({}, reason)]})
            if include_usage:
                usage = chat_usage(event.answer).model_dump()
                yield sse({**chunk, "choices": [], "usage": usage})
        else:
            yield sse(error_body(event.error))
    yield sse("[DONE]")


def _delta(delta: dict[str, str], finish: str | None = None) -> dict[str, object]:
    return {"index": 0, "delta": delta, "finish_reason": finish}


def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def chat_usage(answer: Answer) -> ChatUsage:
    prompt, completion = answer.result.layout.total_len, len(answer.decoded.token_ids)
    return ChatUsage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
