"""An in-memory book of chunk variants, for benchmarks and tests.

The service keeps variants in the tiered store and the catalog (`engine/chunk_cache.py`);
this book does the same job in a dict, with the same rules: the base variant is computed
alone after the system prefix, a request's new variants are added after it, at most
`max_variants` per chunk survive (the least valuable goes: lowest expected savings, the base
variant never), and each request gets, per chunk, the variant of lowest CFO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.cachecraft.choice import Candidate, choose_variant
from engine.cachecraft.variants import drafts_from_request
from engine.kv import ChunkKV
from engine.planners.base import ChunkInput


@dataclass
class _Entry:
    kv: ChunkKV
    stats: object | None


class VariantBook:
    def __init__(self, engine, max_variants: int | None = None):
        self.engine = engine
        self.max_variants = max_variants or engine.config.craft_max_variants
        self._variants: dict[str, list[_Entry]] = {}

    def add_base(self, chunk_id: str, token_ids: Sequence[int]) -> None:
        """Compute the chunk's base variant (if the book does not hold it yet)."""
        if chunk_id not in self._variants:
            self.add(chunk_id, self.engine.encode_chunk(tuple(token_ids)))

    def add(self, chunk_id: str, kv: ChunkKV, stats: object | None = None) -> None:
        """Add a variant computed elsewhere (e.g. a base variant computed at ingest)."""
        entries = [e for e in self._variants.get(chunk_id, []) if e.kv.context != kv.context]
        self._variants[chunk_id] = _keep_most_valuable(entries + [_Entry(kv, stats)], self.max_variants)

    def inputs(self, chunk_ids: Sequence[str]) -> list[ChunkInput]:
        """The request's chunk inputs in this order, each with its variant of lowest CFO."""
        inputs = []
        for i, chunk_id in enumerate(chunk_ids):
            entries = self._variants[chunk_id]
            index, _ = choose_variant([Candidate(e.kv.context, e.stats) for e in entries],
                                      tuple(chunk_ids[:i]), self.engine.config.craft_alpha,
                                      self.engine.config.craft_novelty)
            entry = entries[index]
            inputs.append(ChunkInput(chunk_id, entry.kv.token_ids, entry.kv, entry.stats))
        return inputs

    def record(self, result) -> int:
        """Add the variants a finished request produced; returns how many were added."""
        drafts = drafts_from_request(self.engine, result)
        for draft in drafts:
            self.add(draft.chunk_id, draft.kv, draft.stats)
        return len(drafts)

    def num_variants(self, chunk_id: str) -> int:
        return len(self._variants.get(chunk_id, ()))


def _keep_most_valuable(entries: list[_Entry], limit: int) -> list[_Entry]:
    """The base variant plus the limit - 1 others of highest expected savings, in age order."""
    if len(entries) <= limit:
        return entries
    base = [e for e in entries if not e.kv.context]
    others = [e for e in entries if e.kv.context]
    ranked = sorted(others, key=lambda e: getattr(e.stats, "expected_savings", 0.0) or 0.0, reverse=True)
    kept = set(map(id, ranked[:limit - len(base)]))
    return base + [e for e in others if id(e) in kept]
