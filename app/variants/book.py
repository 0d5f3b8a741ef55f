"""An in-memory book of chunk variants, for benchmarks and tests.

The service keeps variants in the tiered store and the catalog (`app/kvcache/cache.py`);
this book does the same job in a dict, through the same `VariantPolicy`: the base variant is
computed alone after the system prefix, each request gets per chunk the variant its mode may
use (`inputs`), a finished request leaves what its mode leaves (`record`: the exact rows it
computed, and exact variants built where the recent traffic says they repay), and at most
`max_variants` per chunk survive (the least valuable goes, the base variant never).
Builds run at once here (a benchmark charges their work through `build_work`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from app.variants.build import build_variants
from app.variants.harvest import harvest, source_contexts
from app.variants.policy import VariantPolicy
from engine.cachecraft.choice import Candidate
from engine.decoding import Decoded
from engine.kv import ChunkId, ChunkKV
from engine.plan import ChunkInput
from engine.planners import Mode
from engine.result import PrefillResult
from engine.variant_stats import VariantStats

if TYPE_CHECKING:  # annotations only: the engine imports this module
    from engine.engine import Engine


@dataclass
class _Entry:
    kv: ChunkKV
    stats: VariantStats | None
    uses: int = 0
    savings: float | None = None

    def candidate(self) -> Candidate:
        return Candidate(self.kv.context, self.stats, self.uses, self.savings, self.kv.num_bytes)


class VariantBook:
    def __init__(
        self, engine: Engine, max_variants: int | None = None, policy: VariantPolicy | None = None
    ):
        self.engine = engine
        self.policy = policy or VariantPolicy(engine.config, engine.loaded.spec.num_layers)
        self.max_variants = max_variants or engine.config.craft_max_variants
        self._variants: dict[ChunkId, list[_Entry]] = {}
        self.build_work: list[torch.Tensor] = []  # layers_computed of every build run

    def add_base(self, chunk_id: ChunkId, token_ids: Sequence[int]) -> None:
        """Compute the chunk's base variant (if the book does not hold it yet)."""
        if chunk_id not in self._variants:
            self.add(chunk_id, self.engine.encode_chunk(tuple(token_ids)))

    def add(self, chunk_id: ChunkId, kv: ChunkKV, stats: VariantStats | None = None) -> None:
        """Add a variant computed elsewhere (e.g. a base variant computed at ingest)."""
        entries = [e for e in self._variants.get(chunk_id, []) if e.kv.context != kv.context]
        savings = stats.expected_savings if stats is not None and kv.context else None
        entries.append(_Entry(kv, stats, savings=savings))
        kept = self.policy.keep([e.candidate() for e in entries], self.max_variants)
        self._variants[chunk_id] = [entries[i] for i in kept]

    def inputs(
        self, chunk_ids: Sequence[ChunkId], mode: Mode, policy: VariantPolicy | None = None
    ) -> list[ChunkInput]:
        """The request's chunk inputs in this order, each with the variant `mode` uses (by the
        book's policy, or `policy`: e.g. the same variants at another α)."""
        entries = [self._variants[chunk_id] for chunk_id in chunk_ids]
        policy = policy or self.policy
        chosen = policy.choose(
            mode, list(chunk_ids), [[e.candidate() for e in es] for es in entries]
        )
        inputs: list[ChunkInput] = []
        for chunk_id, es, index in zip(chunk_ids, entries, chosen):
            entry = es[index] if index is not None else next(e for e in es if not e.kv.context)
            inputs.append(ChunkInput(chunk_id, entry.kv.token_ids, entry.kv, entry.stats))
        start = policy.compute_from(
            mode, list(chunk_ids), [c.kv.context if c.kv is not None else () for c in inputs]
        )
        # an inline build: the request computes these exactly, `record` keeps them
        if start is not None:
            inputs[start:] = [ChunkInput(c.chunk_id, c.token_ids) for c in inputs[start:]]
        return inputs

    def record(
        self, result: PrefillResult, inputs: Sequence[ChunkInput], decoded: Decoded | None = None
    ) -> int:
        """Count the uses of the request's context variants, then add what it leaves (after its
        decode, `decoded`, when it decoded); returns how many variants were added."""
        self._count_uses(result, inputs)
        contexts = source_contexts(inputs)
        ids = [c.chunk_id for c in inputs]
        added = 0
        if self.policy.harvests(result.mode):
            for chunk_id, kv in harvest(self.engine, result, inputs, decoded):
                self.add(chunk_id, kv, _prior(self.policy, kv))
                added += 1
        if self.policy.should_build(result.mode, ids):
            build = build_variants(self.engine, result, contexts, self.policy, decoded)
            if build.layers_computed is not None:
                self.build_work.append(build.layers_computed)
            for draft in build.drafts:
                self.add(draft.chunk_id, draft.kv, draft.stats)
            added += len(build.drafts)
        return added

    def _count_uses(self, result: PrefillResult, inputs: Sequence[ChunkInput]) -> None:
        for report, chunk in zip(result.chunks, inputs):
            entry = next(
                (e for e in self._variants.get(chunk.chunk_id, ()) if e.kv is chunk.kv), None
            )
            if entry is None or not entry.kv.context:
                continue
            saved = self.policy.saved(report.tokens, report.compute_share)
            entry.savings = self.policy.updated_savings(entry.savings, entry.uses, saved)
            entry.uses += 1

    def stored_bytes(self) -> int:
        """Bytes of every variant the book holds, in memory (the engine's dtype)."""
        return sum(e.kv.num_bytes for entries in self._variants.values() for e in entries)

    def num_variants(self, chunk_id: ChunkId) -> int:
        return len(self._variants.get(chunk_id, ()))

    def contexts(self, chunk_id: ChunkId) -> list[tuple[ChunkId, ...]]:
        return [e.kv.context for e in self._variants.get(chunk_id, ())]


def _prior(policy: VariantPolicy, kv: ChunkKV) -> VariantStats:
    return VariantStats(expected_savings=policy.prior_savings(kv.num_tokens))
