"""APE's reading of reused contexts (arXiv 2502.05431): the rows after the contexts read them with
a temperature on their logits and a scale on their total attention.

A request that asks (`Engine.prefill(..., ape=True)`) gets a `ContextReading`: its contexts are
keys [start, end) (the chunks, between the system prefix and the question). Every query row at a
position >= end (the question's rows, then each decoded token's) attends as APE says, per head,
with l its scaled logits:

    context keys j:  l_j / T + (T - 1) * logsumexp(l_C / T) + log S,   other keys: l_j

then one softmax. Inside the contexts that is softmax(l_C / T); their total mass is that of a
segment whose log-sum-exp is T * logsumexp(l_C / T) + log S, APE's formula, against the prefix's
and the question's own. T = S = 1 is plain attention; S -> 0 reads as if the contexts were
absent. Rows before `end` (the contexts' own, where a blend recomputes them) read as usual.

The arithmetic is float32 on the rows that need it (a question's few dozen, one per decode step);
no kernel of the engine's is changed. The Hugging Face path of the screens is
`bench/fidelity/ape.py` (the same formula, segment by segment).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ApeKnobs:
    """APE's temperature on context logits and scale on the contexts' total attention."""

    temperature: float
    scale: float

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and self.scale > 0):
            raise ValueError(f"APE's knobs must be positive, got {self}")


@dataclass(frozen=True)
class ContextReading:
    """Keys [start, end) are the request's contexts; rows at positions >= end read them by APE."""

    knobs: ApeKnobs
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"contexts [{self.start}, {self.end}) are not a span of keys")

    def reads(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [m]: which query rows at `positions` read the contexts by APE."""
        return positions >= self.end

    def attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """APE's attention of query rows q [heads, m, head_dim] at `positions` (each >= end)
        over keys / values [kv_heads, n, head_dim] (grouped-query heads allowed), a row seeing
        the keys at positions <= its own. Returns [m, heads * head_dim] in q's dtype."""
        heads, rows, head_dim = q.shape
        kv_heads, n = keys.shape[0], keys.shape[1]
        positions = positions.to(q.device)
        if rows and int(positions.min()) < self.end:
            raise ValueError("APE's reading is for rows after the contexts")
        group = heads // kv_heads
        # query head h reads key head h // group: fold each group's heads into rows, so that
        # every key head's K and V are read once (and not copied per query head)
        folded = q.float().reshape(kv_heads, group * rows, head_dim)
        logits = folded @ keys.float().transpose(1, 2) * scale  # [kv_heads, group * m, n]
        contexts = logits[..., self.start : self.end] / self.knobs.temperature
        if self.end > self.start:
            shift = (self.knobs.temperature - 1.0) * torch.logsumexp(contexts, -1, keepdim=True)
            logits[..., self.start : self.end] = contexts + shift + math.log(self.knobs.scale)
        later = torch.arange(n, device=q.device)[None, :] > positions.repeat(group)[:, None]
        weights = torch.softmax(logits.masked_fill_(later, -math.inf), -1)
        out = (weights @ values.float()).reshape(heads, rows, head_dim)
        return out.transpose(0, 1).reshape(rows, heads * head_dim).to(q.dtype)

    def read(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        plain: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """Attention [m, heads * head_dim] of rows q at `positions`: APE's for the rows after
        the contexts, `plain()`'s (every row's plain attention) for the others; `plain` runs
        only where some row needs it."""
        after = self.reads(positions.to(q.device))
        if bool(after.all()):
            return self.attention(q, keys, values, positions, scale)
        out = plain()
        if not bool(after.any()):
            return out
        index = after.nonzero().flatten()
        ape = self.attention(q[:, index], keys, values, positions.to(q.device)[index], scale)
        return out.index_put((index,), ape.to(out.dtype))
