"""The compute floor of a prefill: the arithmetic it cannot avoid, counted from what it ran.

A mode's speed-up over `full` is bounded by the ratio of their matrix arithmetic. Counting it
from the rows each layer really computed (not from the recompute share alone) includes the
attention term, which grows with a row's position: a mode that recomputes late rows pays
more attention per row than one that recomputes early ones. The benchmark prints this
floor next to the measured ratio, so the gap between them is the engine's own overhead.

Per row and layer: 2 * (weights of the layer's projections and MLP) for the linear part,
plus 4 * heads * head_dim * (position + 1) for QK^T and AV over the keys at or before it.
Left out (small next to these): K/V projections of rows dropped at a check layer, selection
scores, norms, RoPE and the copy of cached rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.model.work import WorkTotals


class FlopCounter:
    """Prefill arithmetic of one model, from per-row layer counts."""

    def __init__(self, model: torch.nn.Module, num_heads: int, head_dim: int):
        layer = model.get_submodule("model.layers.0")  # Llama-family layout: every layer alike
        self.linear_per_row = 2 * sum(p.numel() for p in layer.parameters() if p.dim() == 2)
        self.attention_per_key = 4 * num_heads * head_dim

    @classmethod
    def for_engine(cls, engine: Engine) -> FlopCounter:
        spec = engine.loaded.spec
        return cls(engine.loaded.model, spec.num_heads, spec.head_dim)

    def prefill(self, layers_computed: torch.Tensor | None) -> float:
        """FLOPs of a prefill in which row p ran attention + MLP in layers_computed[p] layers
        (a `PrefillResult.layers_computed`; ValueError for a result that did not count them)."""
        if layers_computed is None:
            raise ValueError("this prefill did not count the layers each row ran")
        layers = layers_computed.to(torch.float64).cpu()
        keys = torch.arange(1, layers.numel() + 1, dtype=torch.float64)  # row p sees p + 1 keys
        return float((layers * (self.linear_per_row + self.attention_per_key * keys)).sum())

    def of_work(self, work: WorkTotals) -> float:
        """FLOPs of the runs an `engine.model.work.WorkTotals` interval counted (the same
        formula)."""
        return float(work.layer_rows * self.linear_per_row + work.key_rows * self.attention_per_key)
