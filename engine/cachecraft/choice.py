"""Which stored variant of a chunk to reuse for a request's context: the one of lowest CFO."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.cachecraft.scores import beta_prime, cfo, novelty_coverage


@dataclass(frozen=True)
class Candidate:
    """A stored variant: the ordered chunk ids it was computed after, and its statistics
    (an object with `cci`, `inter_scores`, `token_scores`; None when never measured)."""

    context: tuple[str, ...]
    stats: object | None = None


def variant_cfo(candidate: Candidate, new_context: Sequence[str], alpha: float,
                novelty: bool = True) -> float | None:
    """CFO of reusing `candidate` after `new_context`; 0 for an identical context, None when
    the variant has no statistics to judge by (plan it by deviation instead). `novelty`
    applies the coverage factor ν (see scores.py)."""
    if tuple(candidate.context) == tuple(new_context):
        return 0.0
    stats = candidate.stats
    if stats is None or getattr(stats, "cci", None) is None:
        return None
    inter = getattr(stats, "inter_scores", None) or {}
    coverage = novelty_coverage(candidate.context, new_context) if novelty else 1.0
    return cfo(alpha, stats.cci, beta_prime(inter, candidate.context, new_context), coverage)


def choose_variant(candidates: Sequence[Candidate], new_context: Sequence[str],
                   alpha: float, novelty: bool = True) -> tuple[int, float | None]:
    """(index of the variant to use, its CFO). Lowest CFO wins, the earliest on ties; when no
    candidate can be judged, the base variant (empty context), else the first one, with None."""
    if not candidates:
        raise ValueError("a chunk needs at least one variant to choose from")
    scored = [(value, i) for i, c in enumerate(candidates)
              if (value := variant_cfo(c, new_context, alpha, novelty)) is not None]
    if scored:
        value, index = min(scored)
        return index, value
    base = next((i for i, c in enumerate(candidates) if not c.context), 0)
    return base, None
