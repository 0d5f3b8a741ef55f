"""Which chunk rows of a finished prefill are exact in their context, and keeping them.

A chunk's rows equal what a full prefill of the same prompt computes (to float tolerance)
when every chunk before it is exact and either its cached KV was itself computed after
exactly those chunks (the base variant, for the first chunk) and kept in a float codec, or
every one of its rows ran every layer: a row recomputed over exact inputs is exact, a blended
one is not, and neither is a lossy codec's copy of an exact variant (`engine.kv.exact_context`).
`prefix`
requests compute everything after their exact prefix this way, so all of what they computed
can be kept at no extra compute; a `cachecraft` request usually only its leading chunks, or
all of them when the fidelity guard repaired its decode (its cache is then the reference's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.decoding import Decoded
from engine.kv import ChunkId, ChunkKV, exact_context
from engine.plan import ChunkInput, exact_in_context
from engine.result import PrefillResult

if TYPE_CHECKING:  # annotations only: the engine imports this module
    from engine.engine import Engine


def source_contexts(inputs: Sequence[ChunkInput]) -> list[tuple[ChunkId, ...] | None]:
    """Per chunk input, the context its cached KV is exact in (None: not cached, or rounded
    by a lossy store codec; see `engine.kv.exact_context`)."""
    return [exact_context(c.kv) for c in inputs]


def exact_chunks(
    result: PrefillResult,
    contexts: Sequence[tuple[ChunkId, ...] | None],
    num_layers: int,
    decoded: Decoded | None = None,
) -> list[bool]:
    """Per chunk of `result`, whether its rows in the cache its answer was decoded in
    (`decoded.cache`; the prefill's when `decoded` is None) are exact in this context.

    contexts: per chunk, the context of the cached KV the prefill started from (None: none).
    After a guard repair that cache is the reference prefill's, so every chunk is.
    """
    if decoded is not None and decoded.repaired:
        return [True] * len(result.chunks)
    return exact_in_context(
        [report.chunk_id for report in result.chunks],
        contexts,
        result.layout.chunk_spans,
        result.layers_computed,
        num_layers,
    )


def harvest(
    engine: Engine,
    result: PrefillResult,
    inputs: Sequence[ChunkInput],
    decoded: Decoded | None = None,
) -> list[tuple[ChunkId, ChunkKV]]:
    """(chunk id, KV in this context) of every chunk the request computed exactly and that did
    not load an exact variant of this very context already (one read back through a lossy
    codec is returned: the caller may keep a float copy). `inputs`: the request's chunks, as
    the prefill got them; `decoded`: its decode's record (a repair's cache is all exact).
    Copies rows; computes nothing."""
    ids = [report.chunk_id for report in result.chunks]
    contexts = source_contexts(inputs)
    exact = exact_chunks(result, contexts, engine.loaded.spec.num_layers, decoded)
    kept = []
    for i, (is_exact, context) in enumerate(zip(exact, contexts)):
        if not is_exact or (context is not None and context == tuple(ids[:i])):
            continue
        kept.append((ids[i], chunk_rows(engine, result, i, decoded)))
    return kept


def chunk_rows(
    engine: Engine, result: PrefillResult, index: int, decoded: Decoded | None = None
) -> ChunkKV:
    """Chunk `index` of `result` as a variant of its context (the chunks before it), from the
    cache its answer was decoded in (the prefill's when `decoded` is None)."""
    start, end = result.layout.chunk_spans[index]
    cache = decoded.cache if decoded is not None else result.cache
    return ChunkKV(
        token_ids=result.layout.chunk_ids[index],
        kv=cache.rows(start, end),
        base_position=start,
        fingerprint=engine.fingerprint,
        prefix_digest=engine.prompts.prefix_digest,
        context=tuple(report.chunk_id for report in result.chunks[:index]),
    )
