"""Exact Cache-Craft variants built from a finished request, after the answer is out.

A chunk that was not exact in the request's context (`app/variants/harvest.py`) gets a
variant for that context (signature = ordered ids of the chunks before it): its true KV there
and its statistics measured there. The build prefills the prompt once more, but only from the
first inexact chunk on: the leading chunks that are already exact are served from the
request's own cache, as prefix caching would. Measured on MuSiQue with SmolLM2: reusing exact
variants from three other orders of the same chunks, with no recompute at all, gives a
first-token KL of 0.026 against full prefill, while variants taken from the requests' own
blended KV give 0.31 (no better than base variants), so blended rows are never stored.
Whether a request's build is worth its cost is the policy's call (`VariantPolicy.should_build`).
The first chunk is inexact only when its base variant was read through a lossy store codec;
its draft (empty context) is then the base's exact rows, which the service keeps as a float
copy of the base (`app.kvcache.keys.VariantKeys.base_copy_codec`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from app.variants.harvest import chunk_rows, exact_chunks
from engine.cachecraft.stats import ChunkStats, measure_context_stats
from engine.decoding import Decoded
from engine.kv import ChunkId, ChunkKV
from engine.result import PrefillResult
from engine.variant_stats import VariantStats

if TYPE_CHECKING:  # annotations only: the engine imports this module
    from app.variants.policy import VariantPolicy
    from engine.engine import Engine


@dataclass(frozen=True)
class VariantDraft:
    """A variant ready to be stored: the chunk's id, its KV in the new context, its statistics."""

    chunk_id: ChunkId
    kv: ChunkKV
    stats: VariantStats


@dataclass(frozen=True)
class Build:
    """What a build produced and what it cost: layer-rows per prompt row (None: nothing ran)."""

    drafts: list[VariantDraft]
    layers_computed: torch.Tensor | None = None


def variant_stats(stats: ChunkStats | None, savings: float) -> VariantStats:
    """Catalog statistics of a new variant: the measured ones (if any) and the savings its
    first use is assumed to bring (`VariantPolicy.prior_savings`)."""
    if stats is None:
        return VariantStats(expected_savings=savings)
    return VariantStats(
        a=stats.a,
        b=stats.b,
        cci=stats.cci,
        inter_scores=dict(stats.inter),
        token_scores=list(stats.token_scores),
        expected_savings=savings,
    )


def needs_build(
    engine: Engine,
    result: PrefillResult,
    contexts: Sequence[tuple[ChunkId, ...] | None],
    decoded: Decoded | None = None,
) -> bool:
    """Whether `build_variants` would compute anything: some chunk of `result` was not exact in
    its context (arguments as there). An exact-first or `prefix`-like request has none."""
    return not all(exact_chunks(result, contexts, engine.loaded.spec.num_layers, decoded))


def build_variants(
    engine: Engine,
    result: PrefillResult,
    contexts: Sequence[tuple[ChunkId, ...] | None],
    policy: VariantPolicy,
    decoded: Decoded | None = None,
) -> Build:
    """Exact, measured variants of every chunk of `result` that was not exact in its context.

    contexts: per chunk, the context of the cached KV the request started from (None: none);
    decoded: the request's decode record (after a repair every chunk is exact already).
    Empty (and nothing runs) when every chunk was exact already.
    """
    exact = exact_chunks(result, contexts, engine.loaded.spec.num_layers, decoded)
    skip = next((i for i, is_exact in enumerate(exact) if not is_exact), len(exact))
    if skip == len(exact):
        return Build([])
    ids = [report.chunk_id for report in result.chunks]
    leading = [chunk_rows(engine, result, i, decoded) for i in range(skip)]
    layers = [
        layer for layer in engine.config.craft_stats_layers if layer < engine.loaded.spec.num_layers
    ]
    measured, out = measure_context_stats(
        engine.runner,
        result.layout,
        ids,
        engine.prefix_kv,
        layers,
        all_layers=True,
        exact_chunks=leading,
    )
    drafts = []
    for i, stats in zip(range(skip, len(ids)), measured):
        start, end = result.layout.chunk_spans[i]
        kv = ChunkKV(
            token_ids=result.layout.chunk_ids[i],
            kv=out.cache.rows(start, end),
            base_position=start,
            fingerprint=engine.fingerprint,
            prefix_digest=engine.prompts.prefix_digest,
            context=tuple(ids[:i]),
        )
        drafts.append(
            VariantDraft(ids[i], kv, variant_stats(stats, policy.prior_savings(end - start)))
        )
    return Build(drafts, out.layers_computed)
