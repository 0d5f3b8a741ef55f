"""`ChunkTree`: a prefix tree of chunk sequences, one node per exact-context KV that is stored.

RadixAttention's tree, keyed by chunk ids instead of tokens. The root is the system prefix
(always exact). The node of the path (c1, …, ck) stands for chunk ck's KV computed after the
system prefix and exactly c1 … ck-1 in that order: the variant of ck whose context is
(c1, …, ck-1); a chunk's base variant is the node (c). A node counts the stored variants it
stands for (a chunk's base and the base's float copy are one node, two variants); one
whose count is 0 only joins its stored descendants to the root. A path serves a prompt
exactly as far as its nodes are all held: a held node under a dropped one (stores evict
each variant on its own, not leaf first) does not extend an exact prefix past the gap.

The tree holds ids only: it knows nothing of the store, the catalog or KV bytes, and it is
not thread-safe (its owner locks; `app/kvcache/chunk_tree.py`). It is a guide, not an
authority: whoever loads KV checks the variant's context itself, so a stale node costs a
miss, never a wrong KV.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from engine.kv import ChunkId

Path = tuple[ChunkId, ...]


@dataclass
class TreeNode:
    """One chunk sequence: how many stored variants stand for it, and its continuations."""

    count: int = 0
    children: dict[ChunkId, TreeNode] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        return self.count > 0


class ChunkTree:
    def __init__(self) -> None:
        self.root = TreeNode(count=1)  # the system prefix: always exact

    @staticmethod
    def path_of(chunk_id: ChunkId, context: Sequence[ChunkId]) -> Path:
        """The node of chunk `chunk_id`'s variant computed after `context`."""
        return (*context, chunk_id)

    def add(self, path: Path) -> None:
        """Count one more stored variant for `path` (non-empty), creating nodes on the way."""
        if not path:
            raise ValueError("the root (the system prefix) is not a variant")
        node = self.root
        for chunk_id in path:
            node = node.children.setdefault(chunk_id, TreeNode())
        node.count += 1

    def discard(self, path: Path) -> None:
        """Count one variant of `path` less; nodes left with no count and no children go.
        Discarding a path the tree does not hold does nothing."""
        trail = [self.root]
        for chunk_id in path:
            child = trail[-1].children.get(chunk_id)
            if child is None:
                return
            trail.append(child)
        if len(trail) < 2 or trail[-1].count == 0:
            return
        trail[-1].count -= 1
        for depth in range(len(path), 0, -1):  # prune the empty tail, leaf first
            node = trail[depth]
            if node.count or node.children:
                break
            del trail[depth - 1].children[path[depth - 1]]

    def node(self, path: Path) -> TreeNode | None:
        """The node of `path`, held or not; None if the tree has none."""
        node: TreeNode | None = self.root
        for chunk_id in path:
            node = node.children.get(chunk_id) if node is not None else None
        return node

    def holds(self, path: Path) -> bool:
        """Whether every node from the root to `path` is held: an exact prefix that far."""
        node = self.root
        for chunk_id in path:
            child = node.children.get(chunk_id)
            if child is None or not child.held:
                return False
            node = child
        return True

    def exact_prefix(self, order: Sequence[ChunkId]) -> int:
        """How many leading chunks of `order` a held path covers."""
        node, depth = self.root, 0
        for chunk_id in order:
            child = node.children.get(chunk_id)
            if child is None or not child.held:
                break
            node, depth = child, depth + 1
        return depth

    def paths(self) -> Iterator[tuple[Path, int]]:
        """(path, count) of every node with a count, depth first (tests, debugging)."""
        stack: list[tuple[Path, TreeNode]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            if path and node.count:
                yield path, node.count
            stack.extend(((*path, c), child) for c, child in node.children.items())

    def __len__(self) -> int:
        """Nodes with a count (the root not included)."""
        return sum(1 for _ in self.paths())
