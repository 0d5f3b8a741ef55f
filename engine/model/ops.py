"""The tensor ops of selective recompute, dispatched by device.

Each op has a PyTorch twin that runs anywhere (the reference, used on CPU) and may have a
CUDA kernel from `engine/csrc/` used when the tensors are on a GPU and the kernel library is
built. The engine calls only these functions, never the kernels directly.

Dispatch: `kernels.for_tensor(x)` gives the kernel library for a GPU tensor (None on CPU, with
`KVMOSAIC_KERNELS=off`, or when the library cannot be built); `kernels.launch.supports_*`
says whether the kernel takes this call (dtype, layout); otherwise the `*_twin` runs. The
twins are the reference: the tests hold every kernel to its twin.

Layouts: K/V of one layer is `[kv_heads, tokens, head_dim]`; hidden states `[tokens, hidden]`.
"""

from __future__ import annotations

import torch

from engine import kernels
from engine.kernels import launch


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
    library = kernels.for_tensor(k)
    if library is not None and launch.supports_rope_shift(k, delta, inv_freq):
        return launch.rope_shift_(library, k, delta, inv_freq)
    return rope_shift_twin_(k, delta, inv_freq)


def rope_shift_twin_(
    k: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """The PyTorch reference of `rope_shift_`, any device."""
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


def _shift_cos_sin(
    delta: int | torch.Tensor, inv_freq: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
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
    library = kernels.for_tensor(fresh)
    if library is not None and launch.supports_kv_deviation(fresh, cached):
        return launch.kv_deviation(library, fresh, cached)
    return kv_deviation_twin(fresh, cached)


def kv_deviation_twin(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of `kv_deviation`, any device."""
    diff = fresh.float() - cached.float()
    return diff.square().sum(dim=(0, 2))


def top_rows(
    scores: torch.Tensor, count: int, eligible: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices of the `count` highest scores among `eligible` rows, ascending.

    scores: [tokens]; eligible: bool [tokens] or None (all). Ties keep the earlier row.
    Asking for more rows than are eligible returns all eligible rows. NaN counts as the
    highest score (as in torch.sort) and -0.0 equals 0.0.
    """
    library = kernels.for_tensor(scores)
    if library is not None and launch.supports_top_rows(scores, eligible):
        return launch.top_rows(library, scores, count, eligible)
    return top_rows_twin(scores, count, eligible)


def top_rows_twin(
    scores: torch.Tensor, count: int, eligible: torch.Tensor | None = None
) -> torch.Tensor:
    """The PyTorch reference of `top_rows`, any device.

    A stable descending sort over the eligible rows only: torch.topk does not keep the
    earlier row on ties, and masking ineligible rows to -inf would let them tie with
    eligible rows scored -inf.
    """
    candidates = torch.arange(scores.numel(), device=scores.device)
    if eligible is not None:
        candidates = candidates[eligible.to(scores.device)]
    count = max(0, min(count, candidates.numel()))
    if count == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    order = torch.sort(scores[candidates], descending=True, stable=True).indices[:count]
    return candidates[order].sort().values


def deviation_top_rows(
    fresh: torch.Tensor, cached: torch.Tensor, count: int, eligible: torch.Tensor | None = None
) -> torch.Tensor:
    """`top_rows(kv_deviation(fresh, cached), count, eligible)`, with the deviation kept on the GPU.

    fresh, cached: [kv_heads, tokens, head_dim]; eligible: bool [tokens] or None.
    Returns the ascending indices of the `count` eligible tokens of highest deviation.
    """
    return top_rows(kv_deviation(fresh, cached), count, eligible)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of x along dim -2: x [..., tokens, d] -> [..., len(index), d]."""
    library = kernels.for_tensor(x)
    if library is not None and launch.supports_gather_rows(x, index):
        return launch.gather_rows(library, x, index)
    return gather_rows_twin(x, index)


def gather_rows_twin(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of `gather_rows`, any device."""
    return x.index_select(-2, index)


def scatter_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[..., index, :] = src in place; dst [..., tokens, d], src [..., len(index), d]."""
    library = kernels.for_tensor(dst)
    if library is not None and launch.supports_scatter_rows(dst, index, src):
        return launch.scatter_rows_(library, dst, index, src)
    return scatter_rows_twin_(dst, index, src)


def scatter_rows_twin_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of `scatter_rows_`, any device."""
    dst.index_copy_(dst.dim() - 2, index, src.to(dst.dtype))
    return dst
