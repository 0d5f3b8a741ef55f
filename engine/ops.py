"""The tensor ops of selective recompute, dispatched by device.

Each op has a PyTorch twin that runs anywhere (the reference, used on CPU) and may have a
CUDA kernel from `engine/csrc/` used when the tensors are on a GPU and the kernel library is
built. The engine calls only these functions, never the kernels directly.

Layouts: K/V of one layer is `[kv_heads, tokens, head_dim]`; hidden states `[tokens, hidden]`.
"""

from __future__ import annotations

import math

import torch


def rope_shift_(k: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate keys that already carry RoPE by `delta` more positions, in place; returns `k`.

    k: [..., tokens, head_dim] with the Hugging Face "rotate_half" pairing (i, i + head_dim/2).
    delta: one shift for all rows, or a LongTensor [tokens] of per-row shifts (may be negative).
    inv_freq: [head_dim / 2], the model's rotary frequencies (any rope scaling already applied).
    RoPE rotations compose, so RoPE(p + delta) = R(delta) @ RoPE(p); the angles are formed in
    float64 so the shift adds no error beyond what a fresh RoPE in float32 has itself.
    """
    if isinstance(delta, int) and delta == 0:
        return k
    cos, sin = _shift_cos_sin(delta, inv_freq, k.device)
    half = k.shape[-1] // 2
    first, second = k[..., :half].float(), k[..., half:].float()
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin
    k[..., :half] = rotated_first.to(k.dtype)
    k[..., half:] = rotated_second.to(k.dtype)
    return k


def _shift_cos_sin(delta, inv_freq: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = inv_freq.to(device=device, dtype=torch.float64)
    if isinstance(delta, int):
        angles = freqs * float(delta)  # [half]
    else:
        angles = delta.to(device=device, dtype=torch.float64)[:, None] * freqs  # [tokens, half]
    return angles.cos().float(), angles.sin().float()


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token squared deviation, summed over heads and head_dim, in float32.

    fresh, cached: [kv_heads, tokens, head_dim] -> [tokens]
    """
    diff = fresh.float() - cached.float()
    return diff.square().sum(dim=(0, 2))


def top_rows(scores: torch.Tensor, count: int, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the `count` highest scores among `eligible` rows, ascending.

    scores: [tokens]; eligible: bool [tokens] or None (all). Ties keep the earlier row.
    Asking for more rows than are eligible returns all eligible rows.
    """
    if eligible is not None:
        scores = scores.masked_fill(~eligible, -math.inf)
        count = min(count, int(eligible.sum()))
    count = max(0, min(count, scores.numel()))
    if count == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    picked = torch.topk(scores, count, sorted=False).indices
    return picked.sort().values


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of x along dim -2: x [..., tokens, d] -> [..., len(index), d]."""
    return x.index_select(-2, index)


def scatter_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[..., index, :] = src in place; dst [..., tokens, d], src [..., len(index), d]."""
    dst.index_copy_(dst.dim() - 2, index, src.to(dst.dtype))
    return dst
