"""`POST /ask` (JSON or Server-Sent Events) and `GET /modes`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from app.api.abandon import answer_while_connected, request_label
from app.api.deps import ServicesDep
from app.api.errors import documented, error_body
from app.api.streaming import SSE_HEADERS, AnswerStream, Done, Piece, sse
from app.report import ask_response
from app.schemas.ask import ApeOut, AskRequest, AskResponse, ConditioningOut, ModesResponse
from engine.config import FIDELITIES
from engine.planners import base_reader_names, planner_names

router = APIRouter(tags=["ask"])

STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "with stream=true: `piece` events {text}, then one `report` (or `error`)",
    }
}


@router.get("/modes", response_model=ModesResponse)
def modes(services: ServicesDep) -> ModesResponse:
    s = services.settings
    return ModesResponse(
        modes=planner_names(),
        default=s.default_mode.name,
        top_k=s.default_top_k,
        max_tokens=s.default_max_tokens,
        fidelities=list(FIDELITIES),
        fidelity=s.fidelity.value,
        packets=None if services.engine.packets is None else services.engine.packets.digest(),
        packet_modes=base_reader_names(),
        conditioned=None if (c := s.conditioning()) is None else ConditioningOut(**c.describe()),
        ape=ApeOut(temperature=s.ape_temperature, scale=s.ape_scale),
    )


@router.post(
    "/ask", response_model=AskResponse, responses={**STREAM_DOC, **documented(400, 422, 503)}
)
async def ask(
    body: AskRequest, services: ServicesDep, request: Request
) -> AskResponse | StreamingResponse:
    """Retrieve, prefill by mode reusing chunk KV, decode; report per chunk and per stage."""
    query = services.rag.query(
        question=body.question,
        top_k=body.top_k,
        mode=body.mode,
        ratio=body.ratio,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        fidelity=body.fidelity,
        packets=body.packets,
        conditioned=body.conditioned,
        ape=body.ape,
    )
    tokenizer = services.engine.loaded.tokenizer if body.explain else None
    if not body.stream:
        answer = await answer_while_connected(
            request, services.queue, services.rag, query, services.metrics
        )
        return ask_response(answer, tokenizer)
    stream = AnswerStream.start(services, query, request_label(request))

    async def frames() -> AsyncIterator[str]:
        async for event in stream.events():
            if isinstance(event, Piece):
                yield sse({"text": event.text}, "piece")
            elif isinstance(event, Done):
                yield sse(ask_response(event.answer, tokenizer).model_dump(mode="json"), "report")
            else:
                yield sse(error_body(event.error), "error")

    return StreamingResponse(frames(), media_type="text/event-stream", headers=SSE_HEADERS)
