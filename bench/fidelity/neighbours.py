"""Neighbour-conditioned base KV for the fidelity bench's rows (FusionRAG's offline step).

A row naming `neighbours=K` (`cacheblend@fast[neighbours=2;lead_tokens=64]`) reuses, instead of
each chunk's base computed alone after the system prefix, its KV computed after the openings
(the first `lead_tokens` tokens, default `DEFAULT_LEAD`) of its K nearest passages in the
corpus: every passage of the dataset, embedded by the retriever's MiniLM, nearest by cosine,
the passage itself and copies of its text left out, the nearest placed right before it
(`Engine.encode_after`). The row's mode then moves and fixes it like any base. What it costs at
ingest is reported: tokens computed per chunk token (1.00 for bases alone).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import InvalidRequest
from engine.kv import ChunkId
from engine.plan import ChunkInput

if TYPE_CHECKING:
    from engine.engine import Engine

NEIGHBOURS = "neighbours"  # row setting: how many nearest passages precede each chunk's base
LEAD = "lead_tokens"  # row setting: how many of each neighbour's first tokens
DEFAULT_LEAD = 64
KEYS = frozenset({NEIGHBOURS, LEAD})


@dataclass(frozen=True)
class Conditioning:
    """How a row's bases are computed: after the openings of `neighbours` nearest passages."""

    neighbours: int
    lead_tokens: int = DEFAULT_LEAD

    @classmethod
    def of(cls, label: str, settings: Mapping[str, str]) -> Conditioning | None:
        """The row's conditioning (None: bases alone); InvalidRequest for a bad value."""
        if NEIGHBOURS not in settings:
            if LEAD in settings:
                raise InvalidRequest(f"row {label!r}: {LEAD} needs {NEIGHBOURS}")
            return None
        try:
            out = cls(int(settings[NEIGHBOURS]), int(settings.get(LEAD, DEFAULT_LEAD)))
        except ValueError as exc:
            raise InvalidRequest(f"row {label!r}: {exc}") from exc
        if out.neighbours < 1 or out.lead_tokens < 1:
            raise InvalidRequest(f"row {label!r}: {NEIGHBOURS} and {LEAD} are at least 1")
        return out


@dataclass
class Passage:
    chunk_id: ChunkId
    record: int
    title: str
    text: str


class Neighbourhood:
    """The corpus's passages, their embeddings and each one's nearest others; conditioned
    bases computed on demand, with their ingest cost."""

    def __init__(self, passages: Sequence[Passage], embeddings: np.ndarray):
        if len(passages) != len(embeddings):
            raise ValueError("one embedding per passage")
        self.passages = list(passages)
        self.by_id = {p.chunk_id: i for i, p in enumerate(self.passages)}
        self.embeddings = embeddings
        # per conditioning: chunk tokens, tokens computed, neighbours from the chunk's own
        # record, neighbours drawn
        self.costs: dict[Conditioning, list[int]] = {}
        # per conditioning and chunk: the neighbours' tokens computed before it
        self.lead_tokens: dict[Conditioning, dict[ChunkId, int]] = {}

    @classmethod
    def of_records(
        cls, records: Sequence[Mapping[str, Any]], chunk_id: Callable[[int, int], ChunkId]
    ) -> Neighbourhood:
        """Every passage of `records` (ids by `chunk_id(record, position)`), embedded by the
        retriever's default MiniLM."""
        from retrieval.embedder import Embedder

        passages = [
            Passage(chunk_id(r, i), r, ctx.get("title", ""), ctx["text"])
            for r, record in enumerate(records)
            for i, ctx in enumerate(record["ctxs"])
        ]
        print(f"neighbours: embedding the dataset's {len(passages)} passages", file=sys.stderr)
        vectors = Embedder().encode([f"{p.title}\n{p.text}".strip() for p in passages])
        return cls(passages, np.asarray(vectors, dtype=np.float32))

    def nearest(self, chunk_id: ChunkId, count: int) -> list[Passage]:
        """The `count` passages most similar to `chunk_id`'s, most similar first (itself and
        copies of its text left out)."""
        row = self.by_id[chunk_id]
        own = self.passages[row].text
        order = np.argsort(-(self.embeddings @ self.embeddings[row]), kind="stable")
        picked = [self.passages[j] for j in order if j != row and self.passages[j].text != own]
        return picked[:count]

    def conditioned(
        self, engine: Engine, base: Sequence[ChunkInput], conditioning: Conditioning
    ) -> list[ChunkInput]:
        """`base` with each chunk's KV computed after its neighbours' openings (computed and
        charged on every call: the caller shares them between rows)."""
        return [self._one(engine, chunk, conditioning) for chunk in base]

    def _one(self, engine: Engine, chunk: ChunkInput, conditioning: Conditioning) -> ChunkInput:
        own = self.passages[self.by_id[chunk.chunk_id]]
        near = self.nearest(chunk.chunk_id, conditioning.neighbours)
        lead_ids: list[int] = []
        for passage in reversed(near):  # the nearest right before the chunk
            lead_ids += engine.chunk_ids(passage.text, passage.title)[: conditioning.lead_tokens]
        kv = engine.encode_after(
            chunk.token_ids, lead_ids, tuple(p.chunk_id for p in reversed(near))
        )
        self.lead_tokens.setdefault(conditioning, {})[chunk.chunk_id] = len(lead_ids)
        cost = self.costs.setdefault(conditioning, [0, 0, 0, 0])
        cost[0] += len(chunk.token_ids)
        cost[1] += len(chunk.token_ids) + len(lead_ids)
        cost[2] += sum(p.record == own.record for p in near)
        cost[3] += len(near)
        return dataclasses.replace(chunk, kv=kv)

    def report(self) -> list[str]:
        """Per conditioning, what its bases cost and where their neighbours came from."""
        return [
            f"neighbours={c.neighbours};lead_tokens={c.lead_tokens}: ingest computed "
            f"{computed / tokens:.2f} tokens per chunk token (bases alone: 1.00); {same} of "
            f"{drawn} neighbours from the chunk's own record"
            for c, (tokens, computed, same, drawn) in self.costs.items()
        ]
