"""Query-centric focus: the context rows the question reads, measured before a blend is planned.

A probe runs the question's rows alone over every chunk's reused KV, as `naive` would, up to
`focus_probe_layer`, and scores each context row by the most attention any question row pays it
there (averaged over heads). The `focus_chunks` chunks whose best row scores highest, and the
`focus_rows` share of context rows that score highest, are then recomputed from layer 0 (the
plan pins them); the blend fixes the rest at its ratio. Sources: query-centric selection of
what to recompute (QCFuse), and Cache-Craft's measure of the question's focus on each chunk,
here taken before the plan instead of during it, so that a focused chunk is recomputed from
its first layer. Why the peak over question rows: the row that names the subject finds its
passage; the mean over rows is dominated by the chat template's rows
(docs/benchmarks/reuse-anatomy.md). The probe costs the question's rows up to the probe layer.
"""

from __future__ import annotations

import math

import torch

from engine.model.runner import LayerRunner
from engine.plan import Plan, PlanRequest, QueryView, positions


class _Probe(Plan):
    """The question's rows over the reused chunks; at `layer`, each key's peak attention."""

    def __init__(self, request: PlanRequest, layer: int):
        question = request.question_mask()
        super().__init__(request.all_cached_spans(), positions(question), question)
        self.layer = layer
        self.peak: torch.Tensor | None = None  # [total] float32

    def observes(self, layer: int) -> bool:
        return layer == self.layer

    def observe(self, layer: int, view: QueryView) -> torch.Tensor | None:
        group = view.q.shape[0] // view.keys.shape[0]
        keys = view.keys.float().repeat_interleave(group, 0)  # [heads, total, head_dim]
        scores = (view.q.float() @ keys.transpose(1, 2)) * view.scale  # [heads, m, total]
        key_pos = torch.arange(keys.shape[1], device=keys.device)
        scores.masked_fill_(key_pos[None, None, :] > view.active[None, :, None], float("-inf"))
        self.peak = torch.softmax(scores, dim=-1).mean(0).amax(0).cpu()
        return None


def wants_focus(request: PlanRequest) -> bool:
    """Whether the request's config asks for a probe and has reused context rows to rank."""
    config = request.config
    return (
        config.focus_probe_layer is not None
        and (config.focus_chunks > 0 or config.focus_rows > 0)
        and bool(request.context_mask().any())
    )


def focus_mask(runner: LayerRunner, request: PlanRequest) -> torch.Tensor:
    """bool [total]: the context rows to recompute from layer 0 (module docstring)."""
    config = request.config
    peak = question_peak(runner, request, int(config.focus_probe_layer or 0))
    return top_focus(peak, request, config.focus_chunks, config.focus_rows)


def question_peak(runner: LayerRunner, request: PlanRequest, layer: int) -> torch.Tensor:
    """float32 [total]: the most attention a question row pays each context row at `layer`
    (clamped to the model's last), the question's rows run alone over the reused chunks;
    -1 outside the context."""
    probe = _Probe(request, min(layer, request.num_layers - 1))
    layout = request.layout
    runner.run(
        layout.token_tensor(runner.stack.embed_tokens.weight.device),
        probe,
        capacity=layout.total_len,
        want_logits=False,
        last_layer=probe.layer,
    )
    assert probe.peak is not None  # the probe observes its last layer
    return probe.peak.masked_fill(~request.context_mask(), -1.0)


def ranked_chunks(peak: torch.Tensor, request: PlanRequest) -> list[int]:
    """Chunk indices by their best row's `peak`, highest first."""
    spans = request.layout.chunk_spans
    best = torch.tensor([float(peak[start:end].max()) for start, end in spans])
    return [int(i) for i in best.argsort(descending=True)]


def top_focus(peak: torch.Tensor, request: PlanRequest, chunks: int, rows: float) -> torch.Tensor:
    """bool [total]: the `chunks` top-ranked chunks' context rows and the `rows` share of context
    rows with the highest `peak`."""
    context = request.context_mask()
    focus = torch.zeros_like(context)
    for i in ranked_chunks(peak, request)[:chunks]:
        start, end = request.layout.chunk_spans[i]
        focus[start:end] = context[start:end]
    count = math.ceil(rows * int(context.sum()))
    if count:
        focus[peak.topk(count).indices] = True
    return focus & context
