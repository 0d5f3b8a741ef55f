"""The order stage of a request: between retrieval and loading, the order of its chunks.

`KVMOSAIC_CHUNK_ORDER` names the rule (`app.variants.order.ChunkOrder`): `retrieval` keeps
the retriever's order; `cache-aware` puts first the longest path of the prefix tree of chunk
sequences (`ChunkTreeIndex`) among the retrieved chunks, so those are served from exact-
context variants, then the rest in retrieval rank (`app.variants.order.REST_RULE`). Only
a mode that loads context variants (`VariantPolicy.uses_variants`: `prefix`, `cachecraft`)
is reordered; the others gain nothing from an exact path (`full` reuses nothing, the
blending baselines read base variants only) and keep the retrieval order, whatever the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.kvcache.chunk_tree import ChunkTreeIndex
from app.retrieve import Retrieved
from app.variants.order import ChunkOrder, Ordering


@dataclass(frozen=True)
class OrderedChunks:
    """The retrieved chunks in prompt order, each one's retrieval rank (0 = best), and the
    ordering that placed them (`rule` used, leading chunks on a held path)."""

    retrieved: list[Retrieved]
    ranks: tuple[int, ...]
    ordering: Ordering

    @property
    def reordered(self) -> bool:
        return self.ranks != tuple(range(len(self.ranks)))


def order_retrieved(
    tree: ChunkTreeIndex, retrieved: Sequence[Retrieved], rule: ChunkOrder, uses_variants: bool
) -> OrderedChunks:
    """`retrieved` (retrieval order) in the order `rule` chooses; the retrieval order when
    the mode does not load context variants (`uses_variants` False)."""
    ids = [r.chunk_id for r in retrieved]
    if not uses_variants or len(set(ids)) < len(ids):  # nothing to gain, or no one order per id
        rule = ChunkOrder.RETRIEVAL
    ordering = tree.order(ids, rule)
    if ordering.order == tuple(ids):
        return OrderedChunks(list(retrieved), tuple(range(len(ids))), ordering)
    rank = {chunk_id: i for i, chunk_id in enumerate(ids)}
    by_id = {r.chunk_id: r for r in retrieved}
    return OrderedChunks(
        [by_id[c] for c in ordering.order], tuple(rank[c] for c in ordering.order), ordering
    )
