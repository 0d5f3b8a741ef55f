"""What a fidelity row's cached KV costs to make and to keep: the frontier table's cost columns.

Per record, a row reads its chunks' KV from a variant book (bench/fidelity/fidelity.py,
`mode_books`). `RowStorage` counts, against the chunks' own tokens:
- `ingest_tokens`: tokens the model computed to make the KV the row starts from (a base: its
  chunk's tokens; between learned packets: the packets' tokens too; a neighbour-conditioned
  base: its neighbours' openings too). A warm row's warm-up is charged apart (`warm-up`).
- `stored_bytes`: bytes of every variant in the row's book when its timed requests start, as
  held in memory in the engine's dtype (no store codec; a codec row's codec shrinks it).
A row that reads no cache (`full`) computes and keeps nothing here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine.kv import ChunkId
from engine.plan import ChunkInput


@dataclass(frozen=True)
class RowStorage:
    """One row's cost of cached KV on one record (see the module docstring)."""

    chunk_tokens: int = 0
    ingest_tokens: int = 0
    stored_bytes: int = 0


def row_storage(
    reads_cache: bool,
    plain: Sequence[ChunkInput],
    bases: Sequence[ChunkInput],
    stored_bytes: int,
    lead_tokens: Mapping[ChunkId, int] | None = None,
) -> RowStorage:
    """The cost of the row that starts from `bases` for the record's `plain` chunks, its book
    holding `stored_bytes` (`VariantBook.stored_bytes`: the bases and what a warm-up left);
    `lead_tokens`: per chunk, the neighbours' tokens computed before it (conditioned bases).
    A row that does not read the cache: chunk tokens only."""
    chunk_tokens = sum(len(c.token_ids) for c in plain)
    if not reads_cache:
        return RowStorage(chunk_tokens)
    leads = lead_tokens or {}
    computed = sum(len(c.token_ids) + leads.get(c.chunk_id, 0) for c in bases)
    return RowStorage(chunk_tokens, computed, stored_bytes)


@dataclass(frozen=True)
class StorageFigures:
    """A row's costs over many records: per chunk token, what ingest computed (1.00: a base
    per chunk) and the bytes kept; NaN where no record carries them (a report written
    before these were counted)."""

    ingest_per_token: float = math.nan
    stored_bytes_per_token: float = math.nan


def summarize_storage(samples: Iterable[RowStorage]) -> StorageFigures:
    """Totals over the samples, per chunk token."""
    rows = list(samples)
    tokens = sum(s.chunk_tokens for s in rows)
    if tokens <= 0:
        return StorageFigures()
    return StorageFigures(
        sum(s.ingest_tokens for s in rows) / tokens,
        sum(s.stored_bytes for s in rows) / tokens,
    )


def format_ingest(per_token: float) -> str:
    """Tokens computed at ingest per chunk token, as a multiple (`-`: not counted)."""
    return "-" if math.isnan(per_token) else f"{per_token:.2f}x"


def format_kib(bytes_per_token: float) -> str:
    """Bytes kept per chunk token in KiB (`-`: not counted)."""
    return "-" if math.isnan(bytes_per_token) else f"{bytes_per_token / 1024:.1f}"
