"""What a prefill returns: the cache to decode from, the first logits, TTFT and per-chunk facts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequest
from engine.kv import ChunkId, KVCache
from engine.model.runner import RunOutput
from engine.plan import ChunkDecision, ChunkInput
from engine.prompt import PromptLayout
from engine.serving.guard import AnswerCheck, GuardReport


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


@dataclass
class PrefillResult:
    mode: str
    layout: PromptLayout
    cache: KVCache
    logits: torch.Tensor  # [vocab] float32: the first generated token's distribution
    ttft_s: float
    chunks: list[ChunkReport]
    fallback_reason: str | None = None
    layers_computed: torch.Tensor | None = None  # [prompt rows] layers of attention + MLP per row
    # what the fidelity guard estimated and spent (engine/serving/guard.py)
    guard: GuardReport | None = None
    generated_ids: list[int] = field(default_factory=list)
    # set by Engine.prefill: the guard's watch while decoding (None: unwatched); when it fires,
    # Engine.generate prefills the prompt and the answer so far as the reference would
    answer_check: AnswerCheck | None = None
    # rows exact before the first inexact chunk: a repair keeps them and computes the rest
    exact_rows: int | None = None
    # after a repair: the cache the mode's own prefill produced (`cache` is the exact one
    # decoding went on from); teacher-forced figures read the mode's state from it
    prefill_cache: KVCache | None = None
    repair_layers: torch.Tensor | None = None  # [rows] layers the repair's prefill computed per row
    _decoding: bool = False

    @property
    def repaired(self) -> bool:
        """The guard replaced the cache by the reference prefill of the prompt (and the answer
        so far) while decoding: every prompt row of `cache` is exact now."""
        return self.prefill_cache is not None

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

    def claim_for_decode(self) -> None:
        """Decoding appends to the cache, so a result decodes once."""
        if self._decoding:
            raise InvalidRequest("this prefill result has already been decoded")
        self._decoding = True


def chunk_reports(
    chunks: Sequence[ChunkInput],
    layout: PromptLayout,
    out: RunOutput,
    num_layers: int,
    mode: str,
    decisions: Sequence[ChunkDecision] | None = None,
) -> list[ChunkReport]:
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
    return reports


def _stopped_layer(rows: torch.Tensor) -> int | None:
    """The layer where the chunk's recomputed rows stopped early; None if they never did."""
    stopped = rows[rows >= 0]
    return int(stopped.min()) if stopped.numel() else None
