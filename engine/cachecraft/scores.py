"""The Cache-Craft formulas, as pure functions (see DESIGN.md, "Cache-Craft").

For a variant of chunk C_i computed after the chunks S_old, reused after S_new:
- a = Σ_j inter(C_i, C_j) / (|C_i| |C_j|),  b = intra(C_i) / |C_i|²,  CCI = 1 / (1 + e^(−a/b));
- β  = Σ_{j ∈ S_old ∩ S_new} inter(C_i, C_j) / Σ_{j ∈ S_old} inter(C_i, C_j);
- γ  = discordant pairs among the shared chunks (Kendall τ distance) / C(m, 2);
- β′ = β (1 − γ);  CFO = clamp(α · CCI · (1 − β′), 0, 1);
- recompute ⌈CFO · |C_i|⌉ tokens of highest stored per-token inter-attention.

One extension, on by default (`EngineConfig.craft_novelty`): β only asks whether the chunks
the variant attended to are still there, so a variant computed after one chunk scores
β = 1 when three chunks now precede it. ν = |S_old ∩ S_new| / |S_new| (the share of the new
neighbours the variant has seen) scales β′ down for such contexts: CFO = α·CCI·(1 − β′·ν).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from engine.kv import ChunkId


def cci(a: float, b: float) -> float:
    """Cache Context Impact in [0.5, 1): how much the chunk depends on what precedes it."""
    if b <= 0.0:
        return 1.0 if a > 0.0 else 0.5
    return 1.0 / (1.0 + math.exp(-a / b))


def inter_intra_terms(
    inter: Mapping[ChunkId, float], sizes: Mapping[ChunkId, int], intra: float, num_tokens: int
) -> tuple[float, float]:
    """(a, b) from attention masses: inter per preceding chunk id, intra inside the chunk."""
    a = sum(mass / (num_tokens * sizes[j]) for j, mass in inter.items() if sizes.get(j))
    b = intra / (num_tokens * num_tokens)
    return a, b


def beta(
    inter: Mapping[ChunkId, float], old_context: Sequence[ChunkId], new_context: Sequence[ChunkId]
) -> float:
    """Share of the variant's inter-attention that went to chunks still present before it.

    An empty old context (nothing was attended) gives 1 when the new context is empty too
    (identical) and 0 otherwise: the variant knows nothing of the new neighbours.
    """
    total = sum(inter.get(j, 0.0) for j in old_context)
    if total <= 0.0:
        return 1.0 if set(old_context) == set(new_context) else 0.0
    shared = set(new_context)
    return sum(inter.get(j, 0.0) for j in old_context if j in shared) / total


def gamma(old_context: Sequence[ChunkId], new_context: Sequence[ChunkId]) -> float:
    """Kendall τ distance of the shared chunks' order: discordant pairs / C(m, 2); 0 if m < 2."""
    new_rank = {j: r for r, j in enumerate(new_context)}
    shared = [j for j in old_context if j in new_rank]
    m = len(shared)
    if m < 2:
        return 0.0
    ranks = [new_rank[j] for j in shared]  # in old order
    discordant = sum(1 for x in range(m) for y in range(x + 1, m) if ranks[x] > ranks[y])
    return discordant / (m * (m - 1) / 2)


def beta_prime(
    inter: Mapping[ChunkId, float], old_context: Sequence[ChunkId], new_context: Sequence[ChunkId]
) -> float:
    return beta(inter, old_context, new_context) * (1.0 - gamma(old_context, new_context))


def novelty_coverage(old_context: Sequence[ChunkId], new_context: Sequence[ChunkId]) -> float:
    """ν: the share of the new context's chunks that the variant was computed after (1 if none)."""
    if not new_context:
        return 1.0
    seen = set(old_context)
    return sum(1 for j in new_context if j in seen) / len(new_context)


def cfo(alpha: float, cci_value: float, beta_prime_value: float, coverage: float = 1.0) -> float:
    """Cache Fix Overhead: the share of the chunk's tokens to recompute, in [0, 1]."""
    return min(1.0, max(0.0, alpha * cci_value * (1.0 - beta_prime_value * coverage)))


def recompute_count(cfo_value: float, num_tokens: int) -> int:
    return min(num_tokens, math.ceil(cfo_value * num_tokens - 1e-9))


def top_token_offsets(token_scores: Sequence[float], count: int) -> torch.Tensor:
    """Offsets (ascending) of the `count` tokens of highest score; ties keep the earlier token."""
    if count <= 0:
        return torch.empty(0, dtype=torch.long)
    scores = torch.as_tensor(token_scores, dtype=torch.float64)
    order = torch.sort(scores, descending=True, stable=True).indices[:count]
    return order.sort().values
