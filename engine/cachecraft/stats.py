"""Attention statistics of chunks computed in context: the numbers Cache-Craft plans with.

`measure_context_stats` runs the first layers of the prompt (or all of them) with every row
active (the system prefix from its exact cache), and at each measured layer adds up, per
query row, the attention mass that falls on each segment (prefix, chunk j, ...). Scores are formed
in blocks
of query rows, so memory stays bounded ([heads, block, keys]) even at 8k tokens. Masses are
averaged over heads and measured layers.

It runs after the answer is out (the request path's "store variants" step), so it never
delays the first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cachecraft.scores import cci, inter_intra_terms
from engine.kv import ChunkId, KVSource
from engine.model.runner import LayerRunner, RunOutput
from engine.plan import CachedSpan, Plan, QueryView
from engine.prompt import PromptLayout

ROW_BLOCK = 128


@dataclass(frozen=True)
class ChunkStats:
    """What one chunk's tokens attended to, in one context (see DESIGN.md, Cache-Craft).

    inter: mass to each preceding chunk (by chunk id), summed over the chunk's tokens;
    intra: mass inside the chunk; token_scores: per token, mass to all preceding chunks.
    """

    context: tuple[ChunkId, ...]
    inter: dict[ChunkId, float]
    intra: float
    token_scores: list[float]
    a: float
    b: float
    cci: float


def segment_attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    scale: float,
) -> torch.Tensor:
    """Per query row, the attention mass on each key segment, averaged over heads.

    q: [heads, m, head_dim] (after RoPE); k: [kv_heads, n, head_dim]; q_pos: [m] ascending;
    segments: [n] long in [0, num_segments). Returns [m, num_segments] (rows sum to 1).
    """
    group = q.shape[0] // k.shape[0]
    one_hot = torch.nn.functional.one_hot(segments, num_segments).to(torch.float32)  # [n, S]
    key_pos = torch.arange(k.shape[1], device=k.device)
    out = []
    for start in range(0, q.shape[1], ROW_BLOCK):
        rows = q_pos[start : start + ROW_BLOCK]
        end = int(rows[-1]) + 1
        qb = q[:, start : start + ROW_BLOCK].float()
        kb = k[:, :end].float().repeat_interleave(group, 0)  # [heads, end, head_dim]
        scores = (qb @ kb.transpose(1, 2)) * scale  # [heads, b, end]
        scores.masked_fill_(key_pos[None, None, :end] > rows[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).mean(0)  # [b, end]
        out.append(probs @ one_hot[:end])
    return torch.cat(out, dim=0)


def chunk_stats(
    mass: torch.Tensor, layout: PromptLayout, chunk_ids: Sequence[ChunkId]
) -> list[ChunkStats]:
    """Per-chunk statistics from the per-row segment masses of the whole prompt.

    mass: [total_len, num_chunks + 2] with segment 0 the prefix, 1 + j chunk j, last the
    question (rows outside chunks are ignored).
    """
    sizes = {cid: end - start for cid, (start, end) in zip(chunk_ids, layout.chunk_spans)}
    stats = []
    for i, (_cid, (start, end)) in enumerate(zip(chunk_ids, layout.chunk_spans)):
        rows = mass[start:end]  # [n_i, S]
        before = tuple(chunk_ids[:i])
        inter = {j: float(rows[:, 1 + jj].sum()) for jj, j in enumerate(before)}
        intra = float(rows[:, 1 + i].sum())
        token_scores = rows[:, 1 : 1 + i].sum(dim=1).tolist()
        a, b = inter_intra_terms(inter, sizes, intra, end - start)
        stats.append(ChunkStats(before, inter, intra, token_scores, a, b, cci(a, b)))
    return stats


def measure_context_stats(
    runner: LayerRunner,
    layout: PromptLayout,
    chunk_ids: Sequence[ChunkId],
    prefix_kv: KVSource,
    layers: Sequence[int],
    all_layers: bool = False,
    exact_chunks: Sequence[KVSource] = (),
) -> tuple[list[ChunkStats], RunOutput]:
    """Statistics of the chunks of `layout` in their context, from the given layers.

    Runs layers 0..max(layers) with every row after the system prefix active (every layer
    with `all_layers`, which makes the returned cache the exact KV of this context).
    `exact_chunks`: KV sources of the leading chunks that are already exact in this context;
    they are served from cache instead of computed, and their statistics are left out (only
    the chunks after them are returned, in order). Returns (per-chunk statistics, the run's
    `RunOutput`: its cache and the layer-rows it computed).
    """
    stack = runner.stack
    device = stack.embed_tokens.weight.device
    ids = layout.token_tensor(device)
    total = ids.numel()
    num_segments = len(layout.chunk_ids) + 2
    skip = len(exact_chunks)
    first = (
        layout.chunk_spans[skip][0] if skip < len(layout.chunk_spans) else layout.question_span[0]
    )
    spans = [CachedSpan(0, prefix_kv)] + [
        CachedSpan(start, kv) for kv, (start, _) in zip(exact_chunks, layout.chunk_spans)
    ]
    plan = _MeasurePlan(
        spans,
        torch.arange(first, total),
        torch.ones(total, dtype=torch.bool),
        set(layers),
        _segments(layout, device),
        num_segments,
    )
    last_layer = None if all_layers else max(layers)
    with torch.inference_mode():
        out = runner.run(ids, plan, capacity=total, want_logits=False, last_layer=last_layer)
    mass = torch.zeros(total, num_segments, device=device)
    mass[first:] = torch.stack(plan.masses).mean(0)
    return chunk_stats(mass.cpu(), layout, chunk_ids)[skip:], out


class _MeasurePlan(Plan):
    """Every row after the prefix, every layer; records segment masses at the chosen layers."""

    def __init__(
        self,
        cached_spans: list[CachedSpan],
        initial_active: torch.Tensor,
        pinned: torch.Tensor,
        layers: set[int],
        segments: torch.Tensor,
        num_segments: int,
    ):
        super().__init__(cached_spans, initial_active, pinned)
        self.layers, self.segments, self.num_segments = layers, segments, num_segments
        self.masses: list[torch.Tensor] = []

    def observes(self, layer: int) -> bool:
        return layer in self.layers

    def observe(self, layer: int, view: QueryView) -> None:
        self.masses.append(
            segment_attention_mass(
                view.q, view.keys, view.active, self.segments, self.num_segments, view.scale
            )
        )
        return None


def _segments(layout: PromptLayout, device: torch.device) -> torch.Tensor:
    """Segment per position: 0 prefix, 1 + j chunk j, num_chunks + 1 question."""
    return layout.segment_ids(device) + 1
