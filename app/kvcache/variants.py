"""`ChunkVariants`: which stored variant of each chunk a request uses, and what it leaves.

Through `VariantPolicy` (`app/variants/policy.py`), the one policy the benchmarks use too:
`choose` (per mode, from the catalog), `record_savings` (what each context variant saved,
into the catalog and the store's eviction value), `harvest` (a request's exact rows),
`build` (Cache-Craft's exact variants, run by the background builder) and pruning to
`craft_max_variants` per chunk. Under a lossy base codec, exact rows of a chunk at the head of
a prompt are kept as a float copy of its base (`VariantKeys.base_copy_codec`). `put` stores
any variant: KV first, catalog row second, so a crash in between leaves KV without a row (the
orphan sweep removes it), never a row pointing at half-written KV.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from app.catalog import Catalog, CatalogError, NewVariant, VariantRecord
from app.kvcache.chunk_tree import ChunkTreeIndex
from app.kvcache.keys import VariantKeys
from app.store import KVEntry, TieredStore, entry_from_chunk
from app.store.quant import get_codec
from app.variants.build import build_variants
from app.variants.harvest import harvest
from app.variants.policy import VariantPolicy
from engine.cachecraft.choice import Candidate
from engine.decoding import Decoded
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.kv import ChunkId, ChunkKV, KVSource
from engine.plan import ChunkInput
from engine.planners import Mode
from engine.result import PrefillResult
from engine.variant_stats import VariantStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkRef:
    """A chunk of a request: its catalog id, its token ids, and the variant context wanted
    (ordered ids of the chunks it was computed after; empty = the base variant)."""

    chunk_id: ChunkId
    token_ids: tuple[int, ...]
    context: tuple[ChunkId, ...] = ()
    stats: VariantStats | None = None  # Cache-Craft statistics of that variant, when measured
    compute: bool = False  # load no KV: the request computes this chunk (an inline build)
    conditioning: str = ""  # wanted: its neighbour-conditioned base of this tag, if stored

    def base(self) -> ChunkRef:
        """The same chunk's base variant."""
        return ChunkRef(self.chunk_id, self.token_ids)


class ChunkVariants:
    """Thread-safe (the catalog and the store are); one per engine and store."""

    def __init__(
        self,
        engine: Engine,
        store: TieredStore,
        catalog: Catalog,
        keys: VariantKeys,
        tree: ChunkTreeIndex | None = None,
    ):
        """`tree`: the prefix tree that hears of every variant stored and pruned here."""
        self.engine, self.store, self.catalog, self.keys = engine, store, catalog, keys
        self.tree = tree if tree is not None else ChunkTreeIndex(catalog, keys)
        self.policy = VariantPolicy(engine.config, engine.loaded.spec.num_layers)

    def choose(self, mode: Mode, chunks: Sequence[tuple[ChunkId, Sequence[int]]]) -> list[ChunkRef]:
        """Per chunk (chunk id, token ids), in request order, the stored variant `mode` uses
        (`VariantPolicy.choose`); the base variant when the mode uses no other or none fits."""
        order = [chunk_id for chunk_id, _ in chunks]
        if not self.policy.uses_variants(mode):
            self.policy.traffic.observe(order)
            return [ChunkRef(chunk_id, tuple(token_ids)) for chunk_id, token_ids in chunks]
        records = [self._usable(chunk_id, len(token_ids)) for chunk_id, token_ids in chunks]
        chosen = self.policy.choose(mode, order, [[_candidate(r) for r in rs] for rs in records])
        refs = []
        for (chunk_id, token_ids), rs, index in zip(chunks, records, chosen):
            if index is None:
                refs.append(ChunkRef(chunk_id, tuple(token_ids)))
            else:
                refs.append(
                    ChunkRef(
                        chunk_id, tuple(token_ids), rs[index].context, _measured(rs[index].stats)
                    )
                )
        start = self.policy.compute_from(mode, order, [ref.context for ref in refs])
        if start is not None:  # an inline build: computed exactly here, harvested after
            refs[start:] = [
                ChunkRef(ref.chunk_id, ref.token_ids, compute=True) for ref in refs[start:]
            ]
        return refs

    def _usable(self, chunk_id: ChunkId, num_tokens: int) -> list[VariantRecord]:
        return [
            v
            for v in self._unconditioned(chunk_id)
            if v.prefix_digest == self.engine.prompts.prefix_digest
            and v.storage_dtype == self.keys.codec(v.context)
            and v.num_tokens == num_tokens
        ]

    def _unconditioned(self, chunk_id: ChunkId) -> list[VariantRecord]:
        """The chunk's variants of this model but its neighbour-conditioned bases, which only a
        request that asks reads (by key) and which neither choice nor pruning counts."""
        return [
            v
            for v in self.catalog.variants_of_chunk(chunk_id, self.engine.fingerprint)
            if not v.is_conditioned
        ]

    def record_savings(self, result: PrefillResult, inputs: Sequence[ChunkInput]) -> None:
        """Fold what each context variant of a finished request saved into its running mean
        (catalog `expected_savings`, the store's eviction value). Call after the loaded
        chunks are closed, so their access counts include this use."""
        for report, chunk in zip(result.chunks, inputs):
            if chunk.kv is None or not chunk.kv.context:
                continue
            key = self.keys.key(chunk.token_ids, chunk.kv.context)
            record = self.catalog.get_variant(key)
            if record is None:
                continue
            saved = self.policy.saved(report.tokens, report.compute_share)
            mean = self.policy.updated_savings(
                record.stats.expected_savings, record.access_count - 1, saved
            )
            self.catalog.update_variant_stats(key, VariantStats(expected_savings=mean))
            self.store.set_usage(key, savings=mean)

    def harvest(
        self, result: PrefillResult, inputs: Sequence[ChunkInput], decoded: Decoded | None = None
    ) -> int:
        """Keep the chunk rows the request computed exactly in its context (no compute; after
        its decode `decoded`, whose repair makes every chunk exact); returns how many variants
        were stored. Only for modes whose requests leave variants."""
        if not self.policy.harvests(result.mode):
            return 0
        stored = 0
        for chunk_id, kv in harvest(self.engine, result, inputs, decoded):
            loaded = next((c.kv for c in inputs if c.chunk_id == chunk_id), None)
            stats = VariantStats(expected_savings=self.policy.prior_savings(kv.num_tokens))
            stored += self._keep(chunk_id, kv, stats, loaded)
        return stored

    def build(
        self,
        result: PrefillResult,
        contexts: Sequence[tuple[ChunkId, ...] | None],
        decoded: Decoded | None = None,
    ) -> int:
        """Build and store the exact, measured variants of the request's inexact chunks
        (app/variants/build.py); returns how many were stored. Whether a request is
        worth it is the caller's question (`VariantPolicy.should_build`)."""
        stored = 0
        for draft in build_variants(self.engine, result, contexts, self.policy, decoded).drafts:
            stored += self._keep(draft.chunk_id, draft.kv, draft.stats)
        return stored

    def _keep(
        self, chunk_id: ChunkId, kv: ChunkKV, stats: VariantStats, loaded: KVSource | None = None
    ) -> bool:
        """Store exact rows of `kv.context` unless that adds nothing: a base variant's rows go
        to its exact copy (`VariantKeys.base_copy_codec`; none: the base is stored already),
        and rows of a context whose lossy copy the request `loaded` are not stored again in
        the same lossy codec. True if stored."""
        codec = self.keys.codec(kv.context) if kv.context else self.keys.base_copy_codec
        if codec is None:
            return False
        if (
            loaded is not None
            and tuple(loaded.context) == tuple(kv.context)
            and get_codec(codec).lossy
        ):
            return False
        stored = self.put(chunk_id, kv, stats, codec=codec) is not None
        self._prune(chunk_id)
        return stored

    def _prune(self, chunk_id: ChunkId) -> None:
        """Drop the least valuable context variants beyond the limit (`VariantPolicy.keep`; never
        the base variant or its exact copy, which count toward the limit; the store's eviction
        drops a copy like any entry, and the base serves then; a neighbour-conditioned base is
        not counted and not pruned here). The catalog row goes first, so no request picks a
        variant whose KV is being removed."""
        records = self._unconditioned(chunk_id)
        kept = set(self.policy.keep([_candidate(r) for r in records]))
        doomed = [r for i, r in enumerate(records) if i not in kept]
        if not doomed:
            return
        self.catalog.delete_variants([r.store_key for r in doomed])
        self.tree.removed(r.store_key for r in doomed)
        for record in doomed:
            self.store.remove(record.store_key)

    def put(
        self,
        chunk_id: ChunkId,
        kv: ChunkKV,
        stats: VariantStats | None = None,
        tier: str | None = None,
        codec: str | None = None,
        conditioning: str = "",
    ) -> VariantRecord | None:
        """Store KV of chunk `chunk_id` computed under `kv.context` (ordered ids of the chunks
        before it) with its statistics; KV first, then the catalog row. None if no tier could
        take it (nothing is recorded then). `tier`: start there instead of the first tier (the
        service puts ingested base variants in a persistent tier so they survive a restart).
        `codec`: store it so (default `VariantKeys.codec(kv.context)`; a base variant's exact
        copy is stored in `base_copy_codec`). `conditioning`: the tag of a neighbour-conditioned
        base (`Conditioning.tag`; `kv.lead` names its neighbours), required for one."""
        if bool(kv.lead) != bool(conditioning):
            raise ValueError("a conditioned base is stored with its tag, and only one is")
        if (
            kv.fingerprint != self.engine.fingerprint
            or kv.prefix_digest != self.engine.prompts.prefix_digest
        ):
            raise InvalidRequest("this KV belongs to another model or system prefix")
        codec = codec or self.keys.codec(kv.context)
        entry = entry_from_chunk(kv, codec)
        return self.put_entry(
            chunk_id,
            self.keys.key(kv.token_ids, kv.context, codec, conditioning),
            entry,
            stats or VariantStats(),
            tier,
        )

    def put_entry(
        self,
        chunk_id: ChunkId,
        key: str,
        entry: KVEntry,
        stats: VariantStats,
        tier: str | None = None,
    ) -> VariantRecord | None:
        """`put` of an entry already encoded for storage under `key`."""
        stored_in = self.store.put(key, entry, tier)
        if stored_in is None:
            log.warning("no store tier could take the KV of chunk %s", chunk_id)
            return None
        if stats.expected_savings is not None:
            self.store.set_usage(key, savings=stats.expected_savings)
        meta = entry.meta
        new = NewVariant(
            chunk_id,
            meta.context,
            meta.fingerprint,
            meta.prefix_digest,
            meta.dtype,
            key,
            stored_in,
            entry.num_bytes,
            meta.num_tokens,
            stats,
            meta.lead,
        )
        try:
            record = self.catalog.put_variant(new)
        except CatalogError as exc:  # the chunk was deleted meanwhile: its KV is an orphan
            log.warning("not recording the KV of chunk %s: %s", chunk_id, exc)
            self.store.remove(key)
            return None
        if not meta.lead:  # a conditioned base is exact in no prompt: no path of the tree
            self.tree.stored(key, chunk_id, meta.context, meta.dtype)
        return record


def _candidate(record: VariantRecord) -> Candidate:
    return Candidate(
        record.context,
        _measured(record.stats),
        record.access_count,
        record.stats.expected_savings,
        record.num_bytes,
    )


def _measured(stats: VariantStats | None) -> VariantStats | None:
    """The statistics if they were ever measured (a base variant from ingest has none)."""
    return stats if stats is not None and stats.cci is not None else None
