"""The prefix tree of chunk sequences and the cache-aware order: paths held and dropped, the
search against an exhaustive search over every order, the rest in retrieval rank."""

from __future__ import annotations

import random

import pytest

from app.variants.order import (
    ChunkOrder,
    best_path,
    cache_aware_order,
    exhaustive_best,
    greedy_path,
)
from app.variants.tree import ChunkTree
from engine.errors import InvalidRequest


def tree_of(*paths: tuple[int, ...]) -> ChunkTree:
    tree = ChunkTree()
    for path in paths:
        tree.add(path)
    return tree


def test_a_path_is_exact_only_as_far_as_every_node_is_held():
    tree = tree_of((1,), (1, 2), (1, 2, 3))
    assert tree.exact_prefix([1, 2, 3, 4]) == 3
    tree.discard((1, 2))  # evicted on its own: (1, 2, 3) stays stored but is cut off
    assert tree.node((1, 2, 3)) is not None and tree.node((1, 2, 3)).held
    assert tree.exact_prefix([1, 2, 3]) == 1
    assert not tree.holds((1, 2, 3)) and tree.holds((1,))


def test_discard_counts_variants_and_prunes_empty_nodes():
    tree = tree_of((5,), (5,), (5, 6))
    tree.discard((5, 6))
    assert tree.node((5, 6)) is None  # an empty leaf goes
    tree.discard((5,))
    assert tree.holds((5,))  # the node's second variant (e.g. the base's float copy) still holds it
    tree.discard((5,))
    assert tree.node((5,)) is None and len(tree) == 0
    tree.discard((9, 9))  # never held: nothing happens
    assert list(tree.paths()) == []


def test_cache_aware_order_puts_the_longest_held_path_first_and_the_rest_by_rank():
    tree = tree_of((10,), (20,), (30,), (40,), (30, 10), (30, 10, 40))
    ordering = cache_aware_order(tree, [10, 20, 30, 40, 50])
    assert ordering.order == (30, 10, 40, 20, 50) and ordering.exact == 3


def test_bases_only_keep_the_retrieval_order():
    tree = tree_of((1,), (2,), (3,))
    assert cache_aware_order(tree, [3, 1, 2]).order == (3, 1, 2)
    assert ChunkOrder.RETRIEVAL.order(tree, [3, 1, 2]).order == (3, 1, 2)


def test_equally_long_paths_go_to_the_best_ranked_one():
    tree = tree_of((1,), (2,), (3,), (2, 3), (1, 3))
    assert best_path(tree, [3, 2, 1]) == (2, 3)
    assert best_path(tree, [1, 2, 3]) == (1, 3)


def test_greedy_can_miss_a_deeper_path_that_the_search_finds():
    tree = tree_of((1,), (2,), (2, 3), (2, 3, 4))  # the best-ranked chunk 1 leads nowhere
    assert greedy_path(tree, [1, 2, 3, 4]) == (1,)
    assert best_path(tree, [1, 2, 3, 4]) == (2, 3, 4)


def test_paths_through_chunks_not_retrieved_do_not_count():
    tree = tree_of((1,), (1, 9), (1, 9, 2))
    assert best_path(tree, [1, 2]) == (1,)


def test_retrieval_order_reports_its_exact_prefix():
    tree = tree_of((1,), (1, 2))
    assert ChunkOrder.RETRIEVAL.order(tree, [1, 2, 3]).exact == 2
    with pytest.raises(InvalidRequest, match="unknown chunk order 'shuffled'"):
        ChunkOrder.named("shuffled")


def random_tree(rng: random.Random, chunks: int, paths: int, drop: float) -> ChunkTree:
    """Variants of random orders of random subsets, as requests would leave them; some evicted."""
    tree = ChunkTree()
    for _ in range(paths):
        order = rng.sample(range(chunks), rng.randint(1, min(6, chunks)))
        for depth in range(1, len(order) + 1):
            tree.add(tuple(order[:depth]))
    for path, _ in list(tree.paths()):
        if rng.random() < drop:
            tree.discard(path)
    return tree


@pytest.mark.parametrize("seed", range(40))
def test_the_search_matches_an_exhaustive_search_over_every_order(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, chunks=9, paths=12, drop=0.2)
    retrieved = rng.sample(range(9), 6)
    best = best_path(tree, retrieved)
    assert tree.holds(best) and set(best) <= set(retrieved)
    assert len(best) == exhaustive_best(tree, retrieved)
    assert len(greedy_path(tree, retrieved)) <= len(best)
    ordering = cache_aware_order(tree, retrieved)
    assert sorted(ordering.order) == sorted(retrieved) and tree.exact_prefix(ordering.order) == len(
        best
    )


def test_a_search_cut_by_its_budget_still_returns_a_held_path_at_least_greedy_long():
    tree = tree_of((1,), (2,), (2, 3), (2, 3, 4))
    cut = best_path(tree, [1, 2, 3, 4], budget=2)
    assert tree.holds(cut) and len(cut) >= len(greedy_path(tree, [1, 2, 3, 4]))
