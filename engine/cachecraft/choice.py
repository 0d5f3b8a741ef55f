"""Which stored variant of a chunk to reuse for a request's context: the one cheapest to fix.

A measured variant costs its CFO (the share of the chunk's rows recomputed in every layer).
The base variant, or any variant never measured, is fixed CacheBlend's way instead (rows of
highest KV deviation at the check layers), which costs `blend_cost` (the share of the chunk's
layer-rows a `cacheblend` plan computes, `app.variants.policy.blend_cost`). So a stale or
unrelated variant, whose CFO is high, loses to the base variant plus the blend fix; a variant
computed after exactly the same chunks costs 0 and always wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.cachecraft.scores import beta_prime, cfo, novelty_coverage
from engine.kv import ChunkId
from engine.variant_stats import VariantStats


@dataclass(frozen=True)
class Candidate:
    """A stored variant: the ordered chunk ids it was computed after, and its statistics
    (None when never measured).

    For keeping and evicting (`app.variants.policy.VariantPolicy.keep`): `uses`, how often
    requests chose it; `savings`, the mean model work (token-equivalents) one use saved over
    the fallback; `num_bytes`, its size.
    """

    context: tuple[ChunkId, ...]
    stats: VariantStats | None = None
    uses: int = 0
    savings: float | None = None
    num_bytes: int = 1


def variant_cfo(
    candidate: Candidate, new_context: Sequence[ChunkId], alpha: float, novelty: bool = True
) -> float | None:
    """CFO of reusing `candidate` after `new_context`; 0 for an identical context, None when
    the variant has no statistics to judge by (plan it by deviation instead). `novelty`
    applies the coverage factor ν (see scores.py)."""
    if tuple(candidate.context) == tuple(new_context):
        return 0.0
    stats = candidate.stats
    if stats is None or stats.cci is None:
        return None
    inter = stats.inter_scores or {}
    coverage = novelty_coverage(candidate.context, new_context) if novelty else 1.0
    return cfo(alpha, stats.cci, beta_prime(inter, candidate.context, new_context), coverage)


def choose_variant(
    candidates: Sequence[Candidate],
    new_context: Sequence[ChunkId],
    alpha: float,
    novelty: bool = True,
    blend_cost: float = 1.0,
) -> tuple[int, float | None]:
    """(index of the variant to use, its CFO; None when it will be fixed by deviation).

    Lowest cost wins: a measured variant costs its CFO, the base variant (empty context) and
    unmeasured ones `blend_cost`. On a tie the base variant wins (the deviation fix sees the
    actual KV, the CFO only predicts it), then the earliest candidate.
    """
    if not candidates:
        raise ValueError("a chunk needs at least one variant to choose from")
    scored = []
    for i, candidate in enumerate(candidates):
        value = variant_cfo(candidate, new_context, alpha, novelty)
        cost = blend_cost if value is None else value
        scored.append((cost, value is not None and value > 0.0, bool(candidate.context), i, value))
    cost, _, _, index, value = min(scored)
    return index, value
