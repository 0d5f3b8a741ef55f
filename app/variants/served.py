"""How a prefill served its context tokens: exact, blended or computed.

Per context row (the system prefix and the question are left out):
- computed: the row ran every layer in this request;
- exact: otherwise, its chunk's KV came from a variant computed after exactly the chunks
  before it in this prompt (`engine.kv.exact_context`; a lossy codec's copy is not exact), so
  the row is the full prefill's;
- blended: otherwise, reused from KV computed in another context (the base variant away
  from the head of the prompt, or a variant of other companions), fixed in part or not at all.

This is what reordering chunks moves: exact reuse costs no fidelity, blending does. It
reads the prefill's own plan (`layers_computed`); a fidelity guard's re-run is counted apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv import exact_context
from engine.plan import ChunkInput
from engine.result import PrefillResult


@dataclass(frozen=True)
class ServedTokens:
    """Context tokens by how they were served, and per chunk (prompt order) whether its KV
    came from an exact-context variant."""

    exact: int = 0
    blended: int = 0
    computed: int = 0
    exact_chunks: tuple[bool, ...] = ()

    @property
    def total(self) -> int:
        return self.exact + self.blended + self.computed


def served_tokens(
    result: PrefillResult, inputs: Sequence[ChunkInput], num_layers: int
) -> ServedTokens:
    """Classify `result`'s context rows; `inputs` are the chunks as the prefill got them."""
    ids = [c.chunk_id for c in inputs]
    counts = [0, 0, 0]  # exact, blended, computed
    exact_chunks = []
    for i, (chunk, (start, end)) in enumerate(zip(inputs, result.layout.chunk_spans)):
        context = exact_context(chunk.kv)
        from_exact = context is not None and context == tuple(ids[:i])
        exact_chunks.append(from_exact)
        if result.layers_computed is None:
            full = 0 if chunk.kv is not None else end - start
        else:
            full = int((result.layers_computed[start:end] >= num_layers).sum())
        counts[2] += full
        counts[0 if from_exact else 1] += end - start - full
    return ServedTokens(counts[0], counts[1], counts[2], tuple(exact_chunks))
