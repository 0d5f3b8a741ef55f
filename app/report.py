"""Turn an `Answer` into the API's report: per-chunk facts, timings in ms, token usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from app.kvcache.chunk_cache import COMPUTED_NOW
from app.rag import Answer
from app.retrieve import Retrieved
from app.schemas.ask import AskResponse, ChunkOut, GuardOut, OrderOut, Timings, Usage
from engine.result import ChunkReport
from engine.serving.guard import GuardReport

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PACKET_PIECE = "<packet>"  # the explain view's text of a learned packet's soft token


def ask_response(answer: Answer, tokenizer: PreTrainedTokenizerBase | None = None) -> AskResponse:
    """`tokenizer` given: add each chunk's token pieces and recomputed offsets (explain)."""
    result = answer.result
    chunks = [
        chunk_out(r, report, variant, result.mode.name, tokenizer)
        for r, report, variant in zip(answer.retrieved, result.chunks, answer.variants)
    ]
    for i, chunk in enumerate(chunks):
        chunk.rank = answer.order.ranks[i] if answer.order is not None else i
        chunk.exact = i < len(answer.served.exact_chunks) and answer.served.exact_chunks[i]
    return AskResponse(
        answer=answer.text,
        mode=result.mode.name,
        finish_reason=answer.finish_reason,
        fallback_reason=result.fallback_reason,
        guard=guard_out(answer.decoded.guard),
        chunks=chunks,
        timings=timings(answer),
        usage=usage(answer),
        order=order_out(answer),
        packets=answer.packets,
        conditioned=answer.conditioned,
        ape=answer.ape,
    )


def order_out(answer: Answer) -> OrderOut | None:
    """The order rule the answer's chunks followed and how their tokens were served."""
    if answer.order is None:
        return None
    served = answer.served
    return OrderOut(
        rule=answer.order.ordering.rule.value,
        planned_exact=answer.order.ordering.exact,
        exact_tokens=served.exact,
        blended_tokens=served.blended,
        computed_tokens=served.computed,
    )


def guard_out(report: GuardReport) -> GuardOut:
    """The guard's estimate and spend for the whole request (its prefill and its decode)."""
    margin = None if report.margin is None else round(report.margin, 4)
    repair_margin = None if report.repair_margin is None else round(report.repair_margin, 4)
    return GuardOut(
        fidelity=report.fidelity.value,
        margin=margin,
        threshold=report.threshold,
        estimate=report.estimate,
        escalated=report.escalated,
        spent_ms=round(report.spent_s * 1000, 2),
        repaired_at=report.repaired_at,
        repair_margin=repair_margin,
        repair_ms=round(report.repair_s * 1000, 2),
        repair_reason=report.repair_reason,
        repair_span=report.repair_span,
        skipped_blend=report.skipped_blend,
        exact_first=report.exact_first,
    )


def chunk_out(
    retrieved: Retrieved,
    report: ChunkReport,
    variant: str,
    mode: str,
    tokenizer: PreTrainedTokenizerBase | None,
) -> ChunkOut:
    out = ChunkOut(
        chunk_id=retrieved.chunk.id,
        document_id=retrieved.document.id,
        document=retrieved.document.title,
        source=retrieved.document.source,
        ordinal=retrieved.chunk.ordinal,
        score=round(retrieved.score, 4),
        text=retrieved.chunk.text,
        strategy=report.strategy or mode,
        tokens=report.tokens,
        reused=report.reused,
        recomputed=report.recomputed,
        compute_share=round(report.compute_share, 4),
        cached=report.cached and variant != COMPUTED_NOW,
        variant=variant,
        stopped_layer=report.stopped_layer,
        cfo=report.cfo,
    )
    if tokenizer is not None:
        out.token_texts = token_pieces(tokenizer, retrieved.token_ids)
        out.recomputed_offsets = list(report.recomputed_offsets)
    return out


def token_pieces(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[str]:
    """Each token's text; a learned packet's soft token (an id past the tokenizer's) as
    `PACKET_PIECE`, so that the pieces stay aligned with the chunk's rows."""
    vocabulary = len(tokenizer)
    pieces = iter(tokenizer.batch_decode([[t] for t in token_ids if t < vocabulary]))
    return [PACKET_PIECE if t >= vocabulary else next(pieces) for t in token_ids]


def timings(answer: Answer) -> Timings:
    ms = {k: round(v * 1000, 2) for k, v in answer.stages.items()}
    return Timings(
        retrieve_ms=ms.get("retrieve", 0.0),
        load_ms=ms.get("load", 0.0),
        prefill_ms=ms.get("prefill", 0.0),
        ttft_ms=round(ms.get("load", 0.0) + ms.get("prefill", 0.0), 2),
        decode_ms=ms.get("decode", 0.0),
        store_ms=ms.get("store", 0.0),
        total_ms=ms.get("total", 0.0),
    )


def usage(answer: Answer) -> Usage:
    result = answer.result
    prompt, completion = result.layout.total_len, len(answer.decoded.token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        context_tokens=result.context_tokens,
        recomputed_tokens=result.recomputed_tokens,
        recompute_share=round(result.recompute_share, 4),
    )
