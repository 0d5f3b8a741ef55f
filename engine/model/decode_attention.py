"""Decode attention of one step: each request's query row over its own cache.

Two implementations of one contract, chosen once per engine by `decode_attention`:
- `torch`: `attention.attend_each`, PyTorch's SDPA on one row per request (the twin);
- `native`: `engine/cpu/decode_attention.c`, one call per layer for every row of the step
  (float32 or bfloat16 on the CPU, head_dim 16, 32, 64 or 128; bfloat16 caches are widened
  as they are read and the arithmetic is float32, where SDPA computes in bfloat16). SDPA's CPU
  kernel parallelises a one-row call over its key heads only and runs it per request; the
  kernel splits every request's keys into blocks of 256 and spreads all of them over the
  cores, reading each K and V row once (docs/benchmarks/kernels.md, "Decode attention").
- `auto`: `native` where it applies and its library builds and agrees with the twin on a probe,
  else `torch`.

Both make a row's output independent of its companions, and the lone decode step runs the same
code (`decode.decode_step`), so batched and lone greedy decodes stay token-for-token equal. The
two differ from each other in the last bits (in bfloat16 by the twin's rounding), which
changes no cached KV: prefill never runs this code, and decode rows are never
stored.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.config import DECODE_ATTENTIONS
from engine.cpu import library
from engine.kv import KVCache
from engine.model.attention import attend_each

log = logging.getLogger(__name__)

NATIVE_HEAD_DIMS = (16, 32, 64, 128)
NATIVE_MAX_GROUP = 8
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class StepAttention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [heads, rows, head_dim], rows >= the step's requests (the rest are padding) ->
        [rows, heads * head_dim]; padding rows get zeros."""
        ...


class TorchStepAttention:
    """The twin: `attend_each` over each request's keys up to and including its new row."""

    def __init__(self, caches: Sequence[KVCache], positions: Sequence[int], scale: float):
        self.caches, self.positions, self.scale = caches, positions, scale

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        pairs = list(zip(self.caches, self.positions))
        return attend_each(
            q,
            [c.keys(layer, p + 1) for c, p in pairs],
            [c.values(layer, p + 1) for c, p in pairs],
            self.scale,
        )


class NativeStepAttention:
    """The kernel: one call per layer for every row; the caches' pointers are read once a step.
    Queries come in the caches' dtype or in float32, and the output in the queries' dtype."""

    def __init__(
        self,
        lib: library.CpuLibrary,
        caches: Sequence[KVCache],
        positions: Sequence[int],
        scale: float,
    ):
        dtype = caches[0].data.dtype if caches else torch.float32
        for cache in caches:
            if (
                not cache.data.is_contiguous()
                or cache.data.dtype != dtype
                or cache.data.device.type != "cpu"
                or dtype not in NATIVE_DTYPES
            ):
                raise ValueError(
                    "the native decode attention needs contiguous caches on the CPU, all float32 "
                    "or all bfloat16"
                )
        self.lib, self.caches, self.scale, self.dtype = lib, caches, scale, dtype
        self.cache_dtype = library.CACHE_DTYPES[str(dtype).removeprefix("torch.")]
        self.meta = torch.tensor(
            [
                [c.data.data_ptr() for c in caches],
                [c.capacity for c in caches],
                [p + 1 for p in positions],
            ],
            dtype=torch.int64,
        )
        self.kv_heads, self.head_dim = caches[0].data.shape[2], caches[0].data.shape[4]

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        heads, rows, head_dim = q.shape
        if (
            rows < len(self.caches)
            or q.dtype not in (self.dtype, torch.float32)
            or head_dim != self.head_dim
        ):
            raise ValueError(
                f"queries {tuple(q.shape)} {q.dtype} do not fit {len(self.caches)} {self.dtype} "
                "caches "
                f"of head_dim {self.head_dim}"
            )
        query = q.float()  # the kernel's arithmetic is float32 (a no-op for a float32 q)
        if query.stride(2) != 1:
            query = query.contiguous()
        out = (torch.empty if rows == len(self.caches) else torch.zeros)(
            rows, heads, head_dim, dtype=torch.float32
        )
        status = self.lib.decode_attention(
            len(self.caches),
            ctypes.c_void_p(query.data_ptr()),
            query.stride(0),
            query.stride(1),
            ctypes.c_void_p(self.meta[0].data_ptr()),
            ctypes.c_void_p(self.meta[1].data_ptr()),
            ctypes.c_void_p(self.meta[2].data_ptr()),
            layer,
            self.kv_heads,
            heads // self.kv_heads,
            head_dim,
            self.scale,
            ctypes.c_void_p(out.data_ptr()),
            torch.get_num_threads(),
            self.cache_dtype,
        )
        self.lib.check("kvm_cpu_decode_attention", status)
        return out.reshape(rows, heads * head_dim).to(q.dtype)


class ReadingStepAttention:
    """`inner`'s attention, with the row of each request whose cache has a reading (APE's,
    `KVCache.reading`) computed by that reading over its own keys instead; `inner` runs only
    where some request reads plainly."""

    def __init__(
        self,
        inner: StepAttention,
        caches: Sequence[KVCache],
        positions: Sequence[int],
        scale: float,
    ):
        self.inner, self.caches, self.positions, self.scale = inner, caches, positions, scale
        device = caches[0].data.device if caches else None
        # (row, cache, its position as a tensor) of the rows read otherwise, built once a step
        self.read_rows = [
            (i, cache, torch.tensor([position], device=device))
            for i, (cache, position) in enumerate(zip(caches, positions))
            if cache.reading is not None
        ]
        self.all_read = len(self.read_rows) == len(caches)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        heads, rows, head_dim = q.shape
        out = q.new_zeros(rows, heads * head_dim) if self.all_read else self.inner(layer, q)
        for i, cache, position in self.read_rows:
            assert cache.reading is not None  # read_rows holds only those
            end = int(position) + 1
            out[i] = cache.reading.attention(
                q[:, i : i + 1],
                cache.keys(layer, end),
                cache.values(layer, end),
                position,
                self.scale,
            )[0].to(out.dtype)
        return out


def step_attention(
    kind: str, caches: Sequence[KVCache], positions: Sequence[int], scale: float
) -> StepAttention:
    """The step's attention by `kind` (`torch` or `native`, as `resolve_decode_attention` gave)."""
    if kind == "native":
        lib = library.get()
        if lib is None:  # resolved native, so the library loaded once; it cannot vanish
            raise library.CpuKernelError("the CPU kernel library is unavailable")
        return NativeStepAttention(lib, caches, positions, scale)
    return TorchStepAttention(caches, positions, scale)


def resolve_decode_attention(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> str:
    """`torch` or `native` for a model of these shapes; ValueError for an unknown name, or for
    `native` where it cannot run (with the reason)."""
    if name not in DECODE_ATTENTIONS:
        raise ValueError(
            f"unknown decode attention {name!r}; use one of {', '.join(DECODE_ATTENTIONS)}"
        )
    if name == "torch":
        return name
    reason = _native_unusable(device, dtype, num_heads, num_kv_heads, head_dim)
    if reason is None:
        return "native"
    if name == "native":
        raise ValueError(f"the native decode attention cannot run here: {reason}")
    log.info("decode attention: torch (%s)", reason)
    return "torch"


def _native_unusable(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """Why the kernel cannot serve this model here, or None if it can."""
    group = num_heads // num_kv_heads
    if device.type != "cpu" or dtype not in NATIVE_DTYPES:
        return f"it runs float32 and bfloat16 on the CPU only (model: {dtype} on {device})"
    if (
        head_dim not in NATIVE_HEAD_DIMS
        or not 1 <= group <= NATIVE_MAX_GROUP
        or group * num_kv_heads != num_heads
    ):
        return (
            f"it supports head_dim {', '.join(map(str, NATIVE_HEAD_DIMS))} and up to "
            f"{NATIVE_MAX_GROUP} query heads per key head (model: head_dim {head_dim}, "
            f"{num_heads} / {num_kv_heads} heads)"
        )
    if library.get() is None:
        return f"its library is unavailable: {library.failure()}"
    if not native_agrees(num_heads, num_kv_heads, head_dim, dtype):
        return "it disagreed with the PyTorch twin on a probe"
    return None


def native_agrees(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    tolerance: float = 1e-5,
) -> bool:
    """Whether the kernel on `dtype` caches matches the twin on the same values in float32, on
    random caches of several lengths (a ragged block tail, several blocks, one key) and a padded
    step, to within float32 rounding (bfloat16 queries and outputs are compared before rounding)."""
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 17, 300, 613]
    caches, wide = [], []
    for length in lengths:
        cache = KVCache(2, num_kv_heads, head_dim, length + 3, dtype, torch.device("cpu"))
        cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
        caches.append(cache)
        widened = KVCache(2, num_kv_heads, head_dim, length + 3, torch.float32, torch.device("cpu"))
        widened.data.copy_(cache.data)
        wide.append(widened)
    positions = [n - 1 for n in lengths]
    q = (
        (torch.randn(num_heads, len(lengths) + 1, head_dim, generator=generator) * 2)
        .to(dtype)
        .float()
    )
    lib = library.get()
    if lib is None:
        return False
    with torch.inference_mode():
        for layer in (0, 1):
            # float32 q: no rounding
            got = NativeStepAttention(lib, caches, positions, head_dim**-0.5)(layer, q)
            expected = TorchStepAttention(wide, positions, head_dim**-0.5)(layer, q)
            if not torch.allclose(got, expected, atol=tolerance, rtol=tolerance):
                log.warning(
                    "native decode attention disagrees with torch by %.3g",
                    (got - expected).abs().max().item(),
                )
                return False
    return True
