"""Call the kernels on torch tensors: pointers, layouts, dtype codes and the current stream.

Each function here has the same contract as its op in `engine/model/ops.py`, for the layouts that
its `supports_*` check accepts (the ops fall back to the PyTorch twin otherwise). CUDA
tensors run the CUDA kernel on the current stream of their device; CPU tensors run the
library's host twin of that kernel (kvm_host_*), the same per-element code, which is how
the tests check the kernels' indexing on machines without a GPU.

Caller errors the kernels cannot report without a host round trip are documented, not
checked: an out-of-range row index is skipped (the twin raises instead).
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.library import MAX_DIMS, Layout, Library

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
FREQ_DTYPE_CODES = {**DTYPE_CODES, torch.float64: 3}
# Above this many rows the O(n^2) top-rows passes stop paying; the twin's sort takes over.
TOP_ROWS_MAX = 16384


# -- checks: which calls the kernels take ---------------------------------------------------


def supports_rope_shift(k: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> bool:
    return (
        _writable_rows(k)
        and k.shape[-1] % 2 == 0
        and inv_freq.dtype in FREQ_DTYPE_CODES
        and inv_freq.numel() == k.shape[-1] // 2
        and (isinstance(delta, int) or (delta.dim() == 1 and delta.numel() == k.shape[-2]))
    )


def supports_kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> bool:
    return (
        fresh.dim() == 3
        and fresh.shape == cached.shape
        and fresh.dtype == cached.dtype
        and fresh.dtype in DTYPE_CODES
        and fresh.device == cached.device
    )


def supports_top_rows(scores: torch.Tensor, eligible: torch.Tensor | None) -> bool:
    return (
        scores.dim() == 1
        and scores.numel() <= TOP_ROWS_MAX
        and scores.dtype in DTYPE_CODES
        and (eligible is None or eligible.shape == scores.shape)
    )


def supports_gather_rows(x: torch.Tensor, index: torch.Tensor) -> bool:
    return _rows_tensor(x) and index.dim() == 1 and not index.is_floating_point()


def supports_scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        _writable_rows(dst)
        and src.dtype == dst.dtype
        and src.device == dst.device
        and src.dim() == dst.dim()
        and index.dim() == 1
        and not index.is_floating_point()
        and src.shape[:-2] == dst.shape[:-2]
        and src.shape[-1] == dst.shape[-1]
        and src.shape[-2] == index.numel()
    )


def _rows_tensor(x: torch.Tensor) -> bool:
    return 2 <= x.dim() <= MAX_DIMS and x.dtype in DTYPE_CODES


def _writable_rows(x: torch.Tensor) -> bool:
    """A kernel writes each element once: refuse views that alias (stride 0 over size > 1)."""
    return _rows_tensor(x) and all(
        stride != 0 or size <= 1 for size, stride in zip(x.shape, x.stride())
    )


# -- calls ----------------------------------------------------------------------------------


def rope_shift_(
    library: Library, k: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    if k.numel() == 0:
        return k
    freq = inv_freq.to(k.device).contiguous()
    row_delta = (
        None if isinstance(delta, int) else delta.to(device=k.device, dtype=torch.long).contiguous()
    )
    _call(
        library,
        "rope_shift",
        k,
        _ptr(k),
        DTYPE_CODES[k.dtype],
        _layout(k),
        int(delta) if row_delta is None else 0,
        _ptr(row_delta),
        _ptr(freq),
        FREQ_DTYPE_CODES[freq.dtype],
    )
    return k


def kv_deviation(
    library: Library, fresh: torch.Tensor, cached: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fresh, cached: [kv_heads, tokens, head_dim] -> float32 [tokens] (into `out` if given)."""
    out = _output(out, (fresh.shape[1],), torch.float32, fresh.device)
    if fresh.shape[1] > 0:
        _call(
            library,
            "kv_deviation",
            fresh,
            _ptr(fresh),
            _layout(fresh),
            _ptr(cached),
            _layout(cached),
            DTYPE_CODES[fresh.dtype],
            _ptr(out),
        )
    return out


def top_rows(
    library: Library,
    scores: torch.Tensor,
    count: int,
    eligible: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices of the `count` best eligible rows, ascending (see ops.top_rows)."""
    scores = scores.float().contiguous()
    if eligible is not None:
        eligible = eligible.to(device=scores.device, dtype=torch.bool).contiguous()
        num_eligible = int(eligible.sum())  # one host sync: the output size depends on it
    else:
        num_eligible = scores.numel()
    count = max(0, min(count, num_eligible))
    out = _output(out, (count,), torch.long, scores.device)
    if count > 0:
        flags = torch.empty(scores.numel(), dtype=torch.uint8, device=scores.device)
        eligible_bytes = None if eligible is None else eligible.view(torch.uint8)
        _call(
            library,
            "top_rows",
            scores,
            _ptr(scores),
            scores.numel(),
            _ptr(eligible_bytes),
            count,
            _ptr(flags),
            _ptr(out),
        )
    return out


def gather_rows(
    library: Library, x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., tokens, d] -> rows `index` [..., len(index), d] (into `out` if given)."""
    index = index.to(device=x.device, dtype=torch.long).contiguous()
    out = _output(out, (*x.shape[:-2], index.numel(), x.shape[-1]), x.dtype, x.device)
    if out.numel() > 0:
        _call(
            library,
            "gather_rows",
            x,
            _ptr(x),
            _layout(x),
            _ptr(index),
            index.numel(),
            _ptr(out),
            _layout(out),
            DTYPE_CODES[x.dtype],
        )
    return out


def scatter_rows_(
    library: Library, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor
) -> torch.Tensor:
    """dst[..., index, :] = src in place; duplicate indices leave one of their rows, unspecified."""
    index = index.to(device=dst.device, dtype=torch.long).contiguous()
    if src.numel() > 0:
        _call(
            library,
            "scatter_rows",
            dst,
            _ptr(src),
            _layout(src),
            _ptr(index),
            index.numel(),
            _ptr(dst),
            _layout(dst),
            DTYPE_CODES[dst.dtype],
        )
    return dst


# -- plumbing -------------------------------------------------------------------------------


def _call(library: Library, name: str, like: torch.Tensor, *args: object) -> None:
    """The device entry point on `like`'s current stream, or the host twin for CPU tensors."""
    if like.device.type == "cuda":
        with torch.cuda.device(like.device):
            stream = ctypes.c_void_p(torch.cuda.current_stream(like.device).cuda_stream)
            library.call(f"kvm_{name}", *args, stream)
    else:
        library.call(f"kvm_host_{name}", *args)


def _layout(x: torch.Tensor) -> Layout:
    layout = Layout()
    layout.ndim = x.dim()
    for d, (size, stride) in enumerate(zip(x.shape, x.stride())):
        layout.sizes[d], layout.strides[d] = size, stride
    return layout


def _ptr(x: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if x is None else ctypes.c_void_p(x.data_ptr())


def _output(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != torch.device(device):
        raise ValueError(
            f"out must be {dtype} {tuple(shape)} on {device}, got {out.dtype} {tuple(out.shape)}"
        )
    return out
