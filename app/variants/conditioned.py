"""Neighbour-conditioned bases (FusionRAG's offline step, #57): which chunks precede a chunk's
conditioned base, and what identifies such a base in the store.

A chunk's conditioned base is its KV computed after the openings (the first `lead_tokens` ids)
of its `neighbours` nearest chunks by the retriever's embedding, the nearest right before it
(`Engine.encode_after`), instead of alone after the system prefix. It is a fourth kind of
stored KV beside the base, Cache-Craft's exact context variants and a base's exact copy: exact
in no prompt (`ChunkKV.lead`), so no exact source reads it (the prefix tree and Cache-Craft's
choice leave catalog rows with a lead out) and it is read only where a request asks
(`conditioned: true`, fidelity `fast`, a mode that reads base variants only), in place of the
plain base, which a blend or a focus plan then moves and fixes like any base. On the report
seeds it recovered part of plain reuse's loss where nothing is recomputed and nothing beside a
blend or a focus (docs/benchmarks/second-front.md).

Neighbours are chosen once, when the base is computed (at ingest, or by `kvmosaic condition`
for chunks ingested before): a chunk ingested later does not change an older chunk's lead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import InvalidRequest
from engine.kv import ChunkId

DEFAULT_LEAD_TOKENS = 64  # the screens' and the frontier's opening per neighbour


@dataclass(frozen=True)
class Conditioning:
    """How conditioned bases are computed: after the openings of `neighbours` nearest chunks,
    `lead_tokens` ids of each. Part of the store key (`tag`): a base conditioned otherwise is
    another entry, never read for this one."""

    neighbours: int
    lead_tokens: int = DEFAULT_LEAD_TOKENS

    def __post_init__(self) -> None:
        if self.neighbours < 1 or self.lead_tokens < 1:
            raise InvalidRequest(
                f"conditioned bases need at least 1 neighbour and 1 lead token, got {self}"
            )

    @property
    def tag(self) -> str:
        """What the store key adds for a base conditioned this way."""
        return f"lead:{self.neighbours}x{self.lead_tokens}"

    def describe(self) -> dict[str, int]:
        return {"neighbours": self.neighbours, "lead_tokens": self.lead_tokens}


@dataclass(frozen=True)
class Candidate:
    """A chunk that may precede another's conditioned base: its id, its text (copies of a
    chunk's own text are left out) and its prompt token ids."""

    chunk_id: ChunkId
    text: str
    token_ids: tuple[int, ...]


def nearest(
    own: Candidate, scored: Sequence[tuple[float, Candidate]], count: int
) -> list[Candidate]:
    """The `count` candidates most similar to `own` (higher score: nearer; the retriever's
    inner product of normalised embeddings), most similar first; `own`, copies of its text and
    repeated ids left out. Ties keep the order given."""
    picked: list[Candidate] = []
    seen = {own.chunk_id}
    for _, candidate in sorted(scored, key=lambda pair: -pair[0]):
        if candidate.chunk_id in seen or candidate.text == own.text:
            continue
        seen.add(candidate.chunk_id)
        picked.append(candidate)
        if len(picked) == count:
            break
    return picked


def lead_of(
    near: Sequence[Candidate], lead_tokens: int
) -> tuple[tuple[int, ...], tuple[ChunkId, ...]]:
    """The ids that precede a conditioned base and the chunks they come from, in prompt
    order: the nearest last, right before the chunk, each neighbour's first `lead_tokens`."""
    ordered = list(reversed(near))
    ids = tuple(t for c in ordered for t in c.token_ids[:lead_tokens])
    return ids, tuple(c.chunk_id for c in ordered)
