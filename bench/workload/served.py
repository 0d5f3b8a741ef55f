"""How a cell served its context tokens, and the trace's limit: the oracle's work.

Per cell: the shares of context tokens served exact (from a variant computed after exactly
the chunks before it), blended (reused from KV of another context, fixed in part or not) and
computed (through every layer), over all answered requests (`app.variants.served`).

The oracle: every chunk the trace retrieved before is reused exactly, so only each chunk's
first sighting and every question are computed; nothing is blended. One first sighting per
request is exact too: at the head of its prompt, its base KV from ingest (computed alone
after the system prefix, outside the trace) is its exact KV; the oracle puts the longest
first sighting there. No cache, order or mode serves more context tokens exactly on that
trace, so each cell's shares read as a distance to it. It ignores eviction, and that an
exact variant holds only after the very chunks it was computed after.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.workload.cell import RequestFacts

SERVED_KINDS = ("exact", "blended", "computed")


def served_shares(facts: Sequence[RequestFacts]) -> dict[str, float]:
    """{exact, blended, computed}: shares of the cell's context tokens (empty: no tokens)."""
    totals = [sum(f.served[i] for f in facts) for i in range(len(SERVED_KINDS))]
    whole = sum(totals)
    return {kind: total / whole for kind, total in zip(SERVED_KINDS, totals)} if whole else {}


@dataclass(frozen=True)
class OracleWork:
    """The trace's limit: context tokens in all (`context_tokens`), those it must compute
    (`first_sightings`: first seen in the trace, but not one at the head of its prompt; the
    rest reused exactly) and question tokens (`question_tokens`)."""

    context_tokens: int
    first_sightings: int
    question_tokens: int

    @property
    def exact_share(self) -> float:
        """Share of context tokens the oracle serves exact (the rest it computes)."""
        return 1 - self.first_sightings / self.context_tokens if self.context_tokens else 0.0

    @property
    def rows_vs_full(self) -> float:
        """Prompt rows it computes (first sightings and questions) over `full`'s (every context
        and question row; the system prefix is reused by every mode)."""
        whole = self.context_tokens + self.question_tokens
        return (self.first_sightings + self.question_tokens) / whole if whole else 0.0

    def line(self) -> str:
        return (
            f"oracle (every chunk seen before reused exactly): {self.exact_share:.0%} of "
            f"context tokens exact, {1 - self.exact_share:.0%} computed (first sightings off "
            f"the head), 0% blended; it computes {self.rows_vs_full:.0%} of full's context "
            "and question rows"
        )


def oracle_work(
    retrieved: Sequence[Sequence[int]],
    chunk_tokens: Mapping[int, int],
    question_tokens: Sequence[int],
) -> OracleWork:
    """The oracle of a trace whose request i retrieved `retrieved[i]` (chunk ids) and whose
    question suffix has `question_tokens[i]` tokens; `chunk_tokens`: tokens per chunk id."""
    seen: set[int] = set()
    total = computed = 0
    for chunk_ids in retrieved:
        new = [chunk_tokens[c] for c in dict.fromkeys(chunk_ids) if c not in seen]
        total += sum(chunk_tokens[c] for c in chunk_ids)
        computed += sum(new) - max(
            new, default=0
        )  # the longest first sighting goes first, from its base
        seen.update(chunk_ids)
    return OracleWork(total, computed, sum(question_tokens))
