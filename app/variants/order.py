"""Chunk order of a request: the retriever's, or the longest cached exact path first.

An exact-context variant serves a prompt only at the place it was computed for: after the
system prefix and exactly the chunks of its context, in that order. The retriever's order is
one arbitrary choice among the orders of the same chunks; `cache_aware_order` picks the one
whose leading chunks follow the longest held path of the `ChunkTree` (app/variants/tree.py),
so the most chunks are served exactly, then places the rest by a named rule.

- Objective: chunks on the path (the longest path wins); among paths of one length, the one
  whose chunks come earliest in retrieval order (lexicographically by rank). With only base
  variants every path has length 1 and the retrieval order stays as it was.
- Search: `best_path`, a depth-first search of the tree restricted to the retrieved chunks
  (held nodes only), children in rank order, stopping once every chunk is on the path. It
  finds the optimum of an exhaustive search over every order (`exhaustive_best`;
  `scripts/order_search.py` compares them) within a node budget; past it, the best path
  found so far, never shorter than `greedy_path`'s (the first path the search walks down).
  `greedy_path` always follows the best-ranked held child.
- The rest (`REST_RULE`): after the path, in retrieval rank. The chunks after the path are
  blended or computed anyway; rank order keeps the retriever's choice wherever reuse does
  not ask for another.

What it does not do: load, pin or check KV. The tree may be stale; the loader and the
planner check every variant's context, so a wrong guess costs a miss, never a wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import permutations

from app.variants.tree import ChunkTree, Path, TreeNode
from engine.errors import InvalidRequest
from engine.kv import ChunkId


class ChunkOrder(Enum):
    """The rule that orders a request's chunks (`KVMOSAIC_CHUNK_ORDER`), resolved from its name
    once where the request enters (`named`); `order` applies it."""

    RETRIEVAL = "retrieval"  # the retriever's order, as vLLM's prefix caching sees it
    CACHE_AWARE = "cache-aware"  # the longest held path first, the rest by `REST_RULE`

    @classmethod
    def named(cls, name: str) -> ChunkOrder:
        """The rule called `name`; InvalidRequest naming the known ones otherwise."""
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(rule.value for rule in cls)
            raise InvalidRequest(f"unknown chunk order {name!r}; known: {known}") from None

    def order(self, tree: ChunkTree, retrieved: Sequence[ChunkId]) -> Ordering:
        """`retrieved` (retrieval order, distinct ids) in this rule's order."""
        if self is ChunkOrder.CACHE_AWARE:
            return cache_aware_order(tree, retrieved)
        return Ordering(tuple(retrieved), tree.exact_prefix(retrieved), self)


CHUNK_ORDERS: tuple[str, ...] = tuple(rule.value for rule in ChunkOrder)
REST_RULE = "retrieval rank"  # where the chunks off the path go (see the module docstring)
SEARCH_BUDGET = 4096  # tree nodes `best_path` expands at most per request


@dataclass(frozen=True)
class Ordering:
    """A request's chunk order: `order` (prompt order), `exact` (leading chunks on a held path
    of the tree as it stood), `rule` (the `ChunkOrder` that chose it)."""

    order: tuple[ChunkId, ...]
    exact: int
    rule: ChunkOrder


def cache_aware_order(
    tree: ChunkTree, retrieved: Sequence[ChunkId], budget: int = SEARCH_BUDGET
) -> Ordering:
    """The longest held path among `retrieved` first (`best_path`), the rest by `REST_RULE`."""
    path = best_path(tree, retrieved, budget)
    on_path = set(path)
    return Ordering(
        (*path, *(c for c in retrieved if c not in on_path)), len(path), ChunkOrder.CACHE_AWARE
    )


def greedy_path(tree: ChunkTree, retrieved: Sequence[ChunkId]) -> Path:
    """From the root, always the best-ranked held child among the retrieved chunks."""
    rank = {c: i for i, c in enumerate(retrieved)}
    node, path = tree.root, list[ChunkId]()
    while True:
        options = _held_children(node, rank, path)
        if not options:
            return tuple(path)
        path.append(options[0])
        node = node.children[options[0]]


def best_path(tree: ChunkTree, retrieved: Sequence[ChunkId], budget: int = SEARCH_BUDGET) -> Path:
    """The longest held path whose chunks are all in `retrieved`, the best-ranked among equals.

    Preorder over children in rank order visits equally long paths lexicographically by rank,
    so keeping only strictly longer ones keeps the best-ranked. `budget`: nodes expanded at most.
    """
    rank = {c: i for i, c in enumerate(retrieved)}
    best: Path = ()
    stack: list[tuple[Path, TreeNode]] = [((), tree.root)]
    expanded = 0
    while stack and expanded < budget and len(best) < len(rank):
        path, node = stack.pop()
        expanded += 1
        if len(path) > len(best):
            best = path
        options = _held_children(node, rank, path)
        stack.extend(((*path, c), node.children[c]) for c in reversed(options))
    return best


def exhaustive_best(tree: ChunkTree, retrieved: Sequence[ChunkId]) -> int:
    """The most leading chunks any order of `retrieved` serves exactly (every permutation:
    for checking the search on small sets only)."""
    return max((tree.exact_prefix(order) for order in permutations(retrieved)), default=0)


def _held_children(
    node: TreeNode, rank: dict[ChunkId, int], path: Sequence[ChunkId]
) -> list[ChunkId]:
    """The retrieved chunks that continue `node` with a held node, not on `path`, by rank."""
    return sorted(
        (c for c, child in node.children.items() if child.held and c in rank and c not in path),
        key=rank.__getitem__,
    )
