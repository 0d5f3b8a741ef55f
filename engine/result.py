"""What a prefill returns: the cache to decode from, the first logits, TTFT, per-chunk facts and
the guard's decision. A returned result is never changed: what decoding does is its own record
(`engine/decoding.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv import ChunkId, KVCache
from engine.model.runner import RunOutput
from engine.plan import ChunkDecision, ChunkInput
from engine.planners.registry import Mode
from engine.prompt import PromptLayout
from engine.serving.guard import AnswerWatch, GuardReport


@dataclass(frozen=True)
class ChunkReport:
    """How one chunk was handled.

    recomputed: rows whose KV was recomputed through the last layer of selection (all rows
    for `full`, none for `naive`); reused = tokens - recomputed.
    compute_share: layer-rows computed for this chunk / (tokens * layers).
    recomputed_offsets: offsets within the chunk of the recomputed rows (for display).
    stopped_layer: the layer where early termination stopped the chunk's recompute (None:
    it ran to the last layer, or nothing was recomputed).
    strategy / cfo / variant: the planner's decision for the chunk (strategy defaults to the
    mode's name; cfo and variant are set by Cache-Craft).
    """

    chunk_id: ChunkId
    tokens: int
    recomputed: int
    compute_share: float
    cached: bool
    recomputed_offsets: tuple[int, ...] = ()
    stopped_layer: int | None = None
    strategy: str = ""
    cfo: float | None = None
    variant: tuple[ChunkId, ...] | None = None

    @property
    def reused(self) -> int:
        return self.tokens - self.recomputed


@dataclass(frozen=True)
class PrefillResult:
    """One prefill, as it ran.

    mode: the mode the request named; chunks: per chunk, how it was handled; layers_computed:
    [prompt rows] layers of attention + MLP per row; guard: what the fidelity guard estimated
    and spent at the first token; watch: what the guard watches while this prefill decodes
    (None: unwatched) and exact_rows, the rows exact before the first inexact chunk, which a
    repair keeps.
    """

    mode: Mode
    layout: PromptLayout
    cache: KVCache
    logits: torch.Tensor  # [vocab] float32: the first generated token's distribution
    ttft_s: float
    chunks: tuple[ChunkReport, ...]
    guard: GuardReport
    fallback_reason: str | None = None
    layers_computed: torch.Tensor | None = None
    watch: AnswerWatch | None = None
    exact_rows: int | None = None

    @property
    def context_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    @property
    def recomputed_tokens(self) -> int:
        return sum(c.recomputed for c in self.chunks)

    @property
    def recompute_share(self) -> float:
        """Recomputed context rows / context rows."""
        return self.recomputed_tokens / max(1, self.context_tokens)


def chunk_reports(
    chunks: Sequence[ChunkInput],
    layout: PromptLayout,
    out: RunOutput,
    num_layers: int,
    mode: str,
    decisions: Sequence[ChunkDecision] | None = None,
) -> tuple[ChunkReport, ...]:
    reports = []
    decisions = decisions or [ChunkDecision(mode)] * len(chunks)
    for chunk, decision, (start, end) in zip(chunks, decisions, layout.chunk_spans):
        tokens = end - start
        reports.append(
            ChunkReport(
                chunk_id=chunk.chunk_id,
                tokens=tokens,
                recomputed=int(out.selected[start:end].sum()),
                compute_share=float(out.layers_computed[start:end].sum()) / (tokens * num_layers),
                cached=chunk.kv is not None,
                recomputed_offsets=tuple(
                    int(i) for i in out.selected[start:end].nonzero().flatten()
                ),
                stopped_layer=_stopped_layer(out.stopped_layer[start:end]),
                strategy=decision.strategy,
                cfo=decision.cfo,
                variant=decision.variant,
            )
        )
    return tuple(reports)


def _stopped_layer(rows: torch.Tensor) -> int | None:
    """The layer where the chunk's recomputed rows stopped early; None if they never did."""
    stopped = rows[rows >= 0]
    return int(stopped.min()) if stopped.numel() else None
