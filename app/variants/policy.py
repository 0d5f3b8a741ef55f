"""`VariantPolicy`: the one rule for which variant each chunk of a request uses, which variants
a chunk keeps, what a variant is worth, and when a request's exact variants get built.

The mode's planner class says what it may use and what its requests leave
(`BasePlanner.variant_use` / `leaves`); this object applies that, the same way in the service
(`app/kvcache/cache.py`, variants in the store and the catalog) and in every benchmark
(`app/variants/book.py`, variants in a dict).

Costs are shares of a chunk's layer-rows: a measured variant costs its CFO (rows recomputed in
every layer), the base variant the share a `cacheblend` plan computes (`blend_cost`). Worth is
model work saved, in token-equivalents (layer-rows / layers): a use of a context variant saves
`tokens × (blend_cost − compute share)` over falling back to the base variant and the blend
fix. A variant's value, for keeping it, is its mean saving per use × (uses + 1) / bytes: how
often requests actually chose it and what that saved, not what its statistics promise.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.variants.traffic import RecentTraffic
from engine.cachecraft.choice import Candidate, choose_variant
from engine.config import EngineConfig
from engine.kv import ChunkId
from engine.planners import Mode
from engine.planners.base import VariantUse, VariantYield
from engine.planners.cacheblend import blend_schedule


def blend_cost(config: EngineConfig, num_layers: int, ratio: float | None = None) -> float:
    """Share of a cached chunk's layer-rows that a `cacheblend` plan computes: every row below
    the first check layer, then at each layer the share kept at the last check layer up to it
    (gradual filtering). Counted like `PrefillResult.layers_computed`: a check layer's rows
    that are dropped there count only their K/V projection, which is left out."""
    ratio = config.recompute_ratio if ratio is None else ratio
    shares = blend_schedule(config, ratio, num_layers)
    share, total = 1.0, 0.0
    for layer in range(num_layers):
        share = shares.get(layer, share)
        total += share
    return total / max(1, num_layers)


class VariantPolicy:
    """Thread-safe (the traffic counts take a lock; everything else is pure)."""

    def __init__(self, config: EngineConfig, num_layers: int):
        self.config = config
        self.num_layers = num_layers
        self.blend_cost = blend_cost(config, num_layers)
        self.traffic = RecentTraffic(config.craft_traffic_window)

    # -- choosing --------------------------------------------------------------------------------

    def uses_variants(self, mode: Mode) -> bool:
        """False when the mode plans with base variants only (no catalog lookup needed)."""
        return mode.reuses_cache and mode.variant_use is not VariantUse.BASE

    def choose(
        self, mode: Mode, chunk_ids: Sequence[ChunkId], candidates: Sequence[Sequence[Candidate]]
    ) -> list[int | None]:
        """Per chunk, in request order, the index into its candidates to load; None means the
        base variant (stored or not). Records the request in the recent traffic."""
        self.traffic.observe(chunk_ids)
        use = mode.variant_use
        return [
            self._choose_one(use, tuple(chunk_ids[:i]), options)
            for i, options in enumerate(candidates)
        ]

    def _choose_one(
        self, use: VariantUse, before: tuple[ChunkId, ...], options: Sequence[Candidate]
    ) -> int | None:
        index = None
        if use is VariantUse.EXACT:
            index = next((i for i, c in enumerate(options) if tuple(c.context) == before), None)
        elif use is VariantUse.BEST and options:
            index, _ = choose_variant(
                options, before, self.config.craft_alpha, self.config.craft_novelty, self.blend_cost
            )
        return index if index is not None and options[index].context else None

    # -- leaving ---------------------------------------------------------------------------------

    def harvests(self, mode: Mode) -> bool:
        """Whether the mode's requests keep the chunk rows they computed exactly."""
        return mode.leaves is not VariantYield.NONE

    def should_build(self, mode: Mode, chunk_ids: Sequence[ChunkId]) -> bool:
        """Whether this finished request's exact variants are worth building in the background:
        the mode builds, builds run in the background (`craft_build`), and the request's chunk set
        recurs (`recurs`)."""
        return self.config.craft_build == "background" and self._builds(mode, chunk_ids)

    def compute_from(
        self, mode: Mode, chunk_ids: Sequence[ChunkId], contexts: Sequence[tuple[ChunkId, ...]]
    ) -> int | None:
        """With inline builds: the first chunk that the request itself should compute exactly,
        every chunk after it too (its harvest then keeps them), when its chunk set recurs and
        some chosen variant is not exact; None otherwise. `contexts`: the chosen variants'."""
        if self.config.craft_build != "inline" or not self._builds(mode, chunk_ids):
            return None
        return next(
            (i for i, context in enumerate(contexts) if tuple(context) != tuple(chunk_ids[:i])),
            None,
        )

    def _builds(self, mode: Mode, chunk_ids: Sequence[ChunkId]) -> bool:
        """The mode builds, and its chunk set came up at least `craft_build_after` times before
        in the recent traffic (the request itself was observed when its variants were chosen)."""
        if mode.leaves is not VariantYield.BUILD:
            return False
        return self.traffic.seen(chunk_ids) - 1 >= self.config.craft_build_after

    # -- worth -----------------------------------------------------------------------------------

    def prior_savings(self, num_tokens: int) -> float:
        """Savings assumed for a new context variant before any use: an exact reuse's."""
        return num_tokens * self.blend_cost

    def saved(self, num_tokens: int, compute_share: float) -> float:
        """What one use of a context variant saved over the base variant plus the blend fix."""
        return max(0.0, num_tokens * (self.blend_cost - compute_share))

    @staticmethod
    def updated_savings(mean: float | None, uses_before: int, observed: float) -> float:
        """The running mean of savings per use after one more use."""
        if mean is None or uses_before <= 0:
            return observed
        return (mean * uses_before + observed) / (uses_before + 1)

    @staticmethod
    def value(candidate: Candidate) -> float:
        """Mean savings per use × (uses + 1) / bytes (a new variant is not worthless)."""
        return (
            max(candidate.savings or 0.0, 0.0) * (candidate.uses + 1) / max(1, candidate.num_bytes)
        )

    def keep(self, candidates: Sequence[Candidate], limit: int | None = None) -> list[int]:
        """Indices of the candidates a chunk keeps, in their order: the base variant, then the
        most valuable others up to `limit` (default `craft_max_variants`) in all."""
        limit = self.config.craft_max_variants if limit is None else limit
        if len(candidates) <= limit:
            return list(range(len(candidates)))
        base = [i for i, c in enumerate(candidates) if not c.context]
        others = sorted(
            (i for i, c in enumerate(candidates) if c.context),
            key=lambda i: (self.value(candidates[i]), i),
            reverse=True,
        )
        return sorted(base + others[: max(0, limit - len(base))])
