"""New variants from a finished request: its chunks in a context they had no variant for.

After the answer is out, each such chunk gets a variant for this context (signature =
ordered ids of the chunks before it), with statistics measured in this context. Two sources
of its KV, by `EngineConfig.craft_exact_variants`:
- exact (default): the request's prompt is prefilled in full once more, off the first-token
  path, so every new variant is the chunk's true KV in this context. Measured on MuSiQue
  with SmolLM2: reusing exact variants from three other orders of the same chunks, with no
  recompute at all, gives a first-token KL of 0.026 against full prefill, while variants
  taken from the requests' own blended KV give 0.31 (no better than base variants);
- request: the request's own rows (reused rows plus recomputed ones), and a statistics pass
  over the first layers only; cheap, but an approximation stored as if it were exact.
Nothing here runs before the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cachecraft.stats import ChunkStats, measure_context_stats
from engine.catalog.records import VariantStats
from engine.kv import ChunkKV
from engine.result import PrefillResult


@dataclass(frozen=True)
class VariantDraft:
    """A variant ready to be stored: the chunk's id, its KV in the new context, its statistics."""

    chunk_id: str
    kv: ChunkKV
    stats: VariantStats


def variant_stats(stats: ChunkStats, alpha: float) -> VariantStats:
    """Catalog statistics of a measured chunk; expected savings = tokens a reuse would not
    recompute when the context differs completely (CFO at β′ = 0)."""
    num_tokens = len(stats.token_scores)
    savings = num_tokens * (1.0 - min(1.0, alpha * stats.cci))
    return VariantStats(a=stats.a, b=stats.b, cci=stats.cci, inter_scores=dict(stats.inter),
                        token_scores=list(stats.token_scores), expected_savings=savings)


def drafts_from_request(engine, result: PrefillResult) -> list[VariantDraft]:
    """Variants this request produced: its chunks (but the first, whose base variant is its
    exact KV) that were served from a variant of another context. Empty when there are none
    (and then no pass runs)."""
    config = engine.config
    exact = config.craft_exact_variants
    ids = [report.chunk_id for report in result.chunks]
    wanted = [i for i, report in enumerate(result.chunks)
              if i > 0 and tuple(report.variant or ()) != tuple(ids[:i]) and (exact or report.recomputed > 0)]
    if not wanted:
        return []
    layers = [layer for layer in config.craft_stats_layers if layer < engine.loaded.spec.num_layers]
    measured, exact_cache = measure_context_stats(engine.runner, result.layout, ids, engine.prefix_kv,
                                                  layers, all_layers=exact)
    cache = exact_cache if exact else result.cache
    drafts = []
    for i in wanted:
        start, end = result.layout.chunk_spans[i]
        kv = ChunkKV(token_ids=result.layout.chunk_ids[i], kv=cache.rows(start, end), base_position=start,
                     fingerprint=engine.fingerprint, prefix_digest=engine.prompts.prefix_digest,
                     context=tuple(ids[:i]))
        drafts.append(VariantDraft(ids[i], kv, variant_stats(measured[i], config.craft_alpha)))
    return drafts
