"""Greedy walk and depth-first search against an exhaustive search over every chunk order.

On random prefix trees of chunk sequences (variants of random orders of random chunk
subsets, as requests leave them, some evicted), for random retrieved sets: how many leading
chunks each method serves exactly, against the best of all orders. Pure Python, no model.

    .venv/bin/python scripts/order_search.py [--trials 2000] [--chunks 12] [--top-k 6] [--paths 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.variants.order import best_path, exhaustive_best, greedy_path  # noqa: E402
from app.variants.tree import ChunkTree  # noqa: E402


def random_tree(rng: random.Random, chunks: int, paths: int, depth: int, drop: float) -> ChunkTree:
    tree = ChunkTree()
    for _ in range(paths):
        order = rng.sample(range(chunks), rng.randint(1, min(depth, chunks)))
        for d in range(1, len(order) + 1):
            node = tree.node(tuple(order[:d]))
            if node is None or not node.held:  # one variant per context, as the store keeps it
                tree.add(tuple(order[:d]))
    for path, _ in list(tree.paths()):
        if rng.random() < drop:
            tree.discard(path)
    return tree


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=2000)
    p.add_argument("--chunks", type=int, default=12, help="distinct chunks in the corpus")
    p.add_argument(
        "--top-k", type=int, default=6, help="chunks retrieved per request (exhaustive: k!)"
    )
    p.add_argument(
        "--paths", type=int, default=20, help="earlier requests whose variants the tree holds"
    )
    p.add_argument("--depth", type=int, default=6, help="longest earlier chunk list")
    p.add_argument("--drop", type=float, default=0.15, help="share of variants evicted")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    greedy, best, oracle, retrieval = [], [], [], []
    for _ in range(args.trials):
        tree = random_tree(rng, args.chunks, args.paths, args.depth, args.drop)
        retrieved = rng.sample(range(args.chunks), args.top_k)
        greedy.append(len(greedy_path(tree, retrieved)))
        best.append(len(best_path(tree, retrieved)))
        oracle.append(exhaustive_best(tree, retrieved))
        retrieval.append(tree.exact_prefix(retrieved))
    n = args.trials
    print(
        f"{n} trials: {args.chunks} chunks, top-k {args.top_k}, {args.paths} earlier lists "
        f"(depth <= {args.depth}), {args.drop:.0%} of variants evicted"
    )
    for name, got in (
        ("retrieval order", retrieval),
        ("greedy walk", greedy),
        ("depth-first search", best),
    ):
        short = sum(g < o for g, o in zip(got, oracle))
        print(
            f"  {name:<19} mean exact chunks {statistics.fmean(got):.3f} "
            f"(best order {statistics.fmean(oracle):.3f}); below the best in {short / n:.1%} "
            f"of trials, by {statistics.fmean(o - g for g, o in zip(got, oracle)):.3f} chunks "
            "on average"
        )
    return 0 if best == oracle else 1


if __name__ == "__main__":
    raise SystemExit(main())
