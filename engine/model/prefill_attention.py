"""A prefill tail's attention in bfloat16 on AVX512-BF16 (`engine/cpu/prefill_attention.c`).

`tail_attention(q, k, v, first, scale)` gives rows [first, num_keys) the attention of
`causal_attention`'s tiled tail, computed by the C kernel: bfloat16 pairs multiplied into float32
sums, blocks of keys fixed by position, so a row's bits depend only on its query, its position
and its keys (never on the rows computed with it or the thread count). `available(...)` says
where it runs: a CPU tensor in bfloat16, head size 64, a library built with AVX512-BF16 and no
AMX (where PyTorch's flash kernel already runs bfloat16 on AMX's tiles), unless
KVMOSAIC_PREFILL_ATTENTION=flash keeps PyTorch's flash kernel (read once per process, like
KVMOSAIC_KERNELS: the choice is part of the model fingerprint).
"""

from __future__ import annotations

import functools
import os

import torch

from engine.cpu import library
from engine.errors import KvMosaicError

HEAD_DIM = 64  # the only head size the kernel is built for
ENV = "KVMOSAIC_PREFILL_ATTENTION"
CHOICES = ("auto", "flash")


@functools.cache
def _cpu_allows() -> bool:
    """The library built for this CPU has the kernel (AVX512-BF16, no AMX: its build says) and
    the setting does not refuse it."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise KvMosaicError(f"{ENV}={choice!r}; use one of {', '.join(CHOICES)}")
    if choice == "flash":
        return False
    lib = library.get()
    return lib is not None and lib.prefill_attention_supported


def available(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `tail_attention` runs these tensors."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and k.dtype == torch.bfloat16
        and q.shape[-1] == HEAD_DIM
        and q.shape[0] % k.shape[0] == 0
        and _cpu_allows()
    )


def kernel_for(dtype: torch.dtype, device: torch.device) -> str:
    """Which kernel a prefill tail's attention runs for a model of `dtype` on `device`: this
    module's C kernel (`avx512-bf16`), PyTorch's CPU flash kernel by tiles (`flash`), or SDPA
    (`sdpa`, CUDA). For the fingerprint and the start-up line."""
    if device.type != "cpu":
        return "sdpa"
    return "avx512-bf16" if dtype == torch.bfloat16 and _cpu_allows() else "flash"


def tail_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float
) -> torch.Tensor:
    """Rows [first, num_keys): q [heads, m, 64], k and v [kv_heads, >= num_keys, 64] with
    num_keys = first + m, all bfloat16 on the CPU. Returns [heads, m, 64]."""
    heads, rows, head_dim = q.shape
    kv_heads = k.shape[0]
    keys, values = k[:, : first + rows], v[:, : first + rows]
    if keys.stride(2) != 1 or keys.stride() != values.stride():
        keys, values = keys.contiguous(), values.contiguous()
    if q.stride(2) != 1:
        q = q.contiguous()
    out = q.new_empty(heads, rows, head_dim)
    lib = library.get()
    assert lib is not None
    status = lib.prefill_attention(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        out.data_ptr(),
        heads,
        kv_heads,
        rows,
        first,
        head_dim,
        scale,
    )
    lib.check("kvm_cpu_prefill_attention", status)
    return out
