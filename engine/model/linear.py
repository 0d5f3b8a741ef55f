"""Which kernel computes the model's linear layers (q/k/v/o, MLP, lm_head) on the CPU.

PyTorch sends a float32 `nn.Linear` on the CPU to its BLAS (MKL in the x86 wheels). On an AMD
EPYC MKL was much slower than oneDNN, the library PyTorch already uses for bfloat16 and its
compiler uses for float32, on every shape that matters here; on an Intel Xeon MKL was the
faster at float32 decode (`python -m bench.compute.linear`; docs/benchmarks/kernels.md).

So `onednn` replaces every `nn.Linear` of the model with `OneDnnLinear`, which calls oneDNN's
linear (`torch.ops.mkldnn._linear_pointwise`, the op the PyTorch compiler emits for CPU
linears) on the same weight tensors: no copy, same parameter names and state dict, tied
weights stay tied. Results differ from MKL's in the last bits, so the kernel is part of the
model's fingerprint (KV computed by one is never reused as exact under the other). Rows are computed
alike whatever block they sit in, as with MKL: a
multi-row product gives each row the same bits inside any larger product (a single row takes
a matrix-vector path in both libraries, which the decode step's row multiple accounts for).

`auto` picks `onednn` for bfloat16 models on the CPU, and for float32 ones unless the CPU is
Intel's and torch has MKL, when the op exists and a probe agrees with
`torch.nn.functional.linear` to float32 rounding; else `torch` (CUDA, other builds, other
dtypes, float32 on Intel).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path

import torch

from engine.config import LINEAR_KERNELS

log = logging.getLogger(__name__)

_ONEDNN_LINEAR: Callable[..., torch.Tensor] | None = getattr(
    getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None
)
# a weight copied into oneDNN's blocked layout for products of a given row count
_ONEDNN_PACK: Callable[..., torch.Tensor] | None = getattr(
    getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None
)
# Set while a prefill's products run in calls of any row count (engine/serving/row_bits.py
# found their bits do not depend on it, packed copy included): they read the packed copy too.
_PACKED_FOR_ANY_ROWS: ContextVar[bool] = ContextVar("packed_for_any_rows", default=False)


@contextmanager
def packed_for_any_rows() -> Iterator[None]:
    """Within it, this thread's bfloat16 oneDNN products of two or more rows read the packed
    weight whatever their row count (a single row keeps the matrix-vector path)."""
    token = _PACKED_FOR_ANY_ROWS.set(True)
    try:
        yield
    finally:
        _PACKED_FOR_ANY_ROWS.reset(token)


class OneDnnLinear(torch.nn.Module):
    """`nn.Linear`'s forward by oneDNN, on the wrapped layer's own weight and bias tensors.

    Inference only (the op has no gradient); inputs [..., in_features] in the weight's dtype.

    In bfloat16, products of exactly `packed_rows` rows (a prefill's row tiles,
    engine/model/row_tiles.py), and of any two or more within `packed_for_any_rows`, read a copy
    of the weight kept in oneDNN's blocked layout, made on the first such product: otherwise each
    tile would copy the weight into that layout again.
    The copy costs the weight's size once more in memory; a deep copy of the layer leaves it out.
    """

    def __init__(self, linear: torch.nn.Linear, packed_rows: int | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: tied weights stay tied
        self.bias = linear.bias
        self.packed_rows = packed_rows
        # (the weight it was made from, its dtype): the copy, or None until first used
        self._packed: tuple[tuple[int, torch.dtype], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert _ONEDNN_LINEAR is not None  # only built where the op exists
        weight = self._packed_weight() if self._reads_packed(x) else None
        return _ONEDNN_LINEAR(
            x, self.weight if weight is None else weight, self.bias, "none", [], ""
        )

    def _reads_packed(self, x: torch.Tensor) -> bool:
        if x.dim() != 2 or self.packed_rows is None:
            return False
        rows = x.shape[0]
        return rows == self.packed_rows or (rows > 1 and _PACKED_FOR_ANY_ROWS.get())

    def _packed_weight(self) -> torch.Tensor | None:
        if _ONEDNN_PACK is None or self.weight.dtype != torch.bfloat16:
            return None
        source = (self.weight.data_ptr(), self.weight.dtype)  # a cast or reload changes it
        if self._packed is None or self._packed[0] != source:
            self._packed = (source, _ONEDNN_PACK(self.weight.detach(), self.packed_rows))
        return self._packed[1]

    def __getstate__(self) -> dict[str, object]:
        # oneDNN's blocked tensors have no storage to copy: a copy packs its own on first use
        state = dict(self.__dict__)
        state["_packed"] = None
        return state

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


def resolve_linear_kernel(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`torch` or `onednn` for a model on `device` in `dtype`; ValueError for an unknown name
    or for `onednn` where it cannot run."""
    if name not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernel {name!r}; use one of {', '.join(LINEAR_KERNELS)}")
    if name == "torch" or (name == "auto" and dtype == torch.float32 and mkl_is_at_home()):
        return "torch"
    usable = (
        device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn_agrees(dtype)
    )
    if name == "onednn" and not usable:
        raise ValueError(
            f"the onednn linear kernel needs a float32 or bfloat16 model on the CPU and a "
            f"PyTorch build with oneDNN (model: {dtype} on {device})"
        )
    return "onednn" if usable else "torch"


@cache
def mkl_is_at_home() -> bool:
    """Whether torch's float32 products run on MKL on an Intel CPU (`/proc/cpuinfo`), where
    MKL beats oneDNN at decode (the module's docstring)."""
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    return any(
        line.split(":")[0].strip() == "vendor_id" and line.split(":")[1].strip() == "GenuineIntel"
        for line in lines
    )


def onednn_agrees(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear exists and matches torch's on a small probe (with bias, 1 and
    5 rows, a non-contiguous input) to within the dtype's rounding."""
    if _ONEDNN_LINEAR is None or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(24, 40, generator=generator) / 8).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    try:
        with torch.inference_mode():
            for x in (
                torch.randn(1, 40, generator=generator),
                torch.randn(40, 5, generator=generator).t(),
            ):
                x = x.to(dtype)
                expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
                got = _ONEDNN_LINEAR(x, weight, bias, "none", [], "").float()
                if got.shape != expected.shape or not torch.allclose(
                    got, expected, atol=tolerance, rtol=tolerance
                ):
                    return False
    except RuntimeError:  # a build whose op refuses these inputs
        log.warning("oneDNN linear is present but failed its probe; using torch's", exc_info=True)
        return False
    return True


def use_linear_kernel(model: torch.nn.Module, name: str, packed_rows: int | None = None) -> str:
    """Make `model`'s linear layers run on kernel `name` (see `resolve_linear_kernel`), in
    place; returns the kernel used. `torch` leaves the model as it is. On oneDNN, products of
    `packed_rows` rows read a packed copy of the weight (`OneDnnLinear`)."""
    kernel = resolve_linear_kernel(
        name, next(model.parameters()).device, next(model.parameters()).dtype
    )
    if kernel == "onednn":
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, child_name, OneDnnLinear(child, packed_rows))
    return kernel


def fit_linear_kernel(model: torch.nn.Module) -> str:
    """After `model` was cast to another dtype: put torch's `nn.Linear` back (on the same
    tensors, in place) where oneDNN's linear does not run in the new dtype on this CPU (a probe
    says so); returns the kernel `model` now runs on. A torch model is left as it is."""
    if linear_kernel_of(model) == "torch" or onednn_agrees(next(model.parameters()).dtype):
        return linear_kernel_of(model)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, OneDnnLinear):
                setattr(parent, child_name, _torch_linear(child))
    return "torch"


def _torch_linear(wrapped: OneDnnLinear) -> torch.nn.Linear:
    linear = torch.nn.Linear(
        wrapped.in_features, wrapped.out_features, bias=wrapped.bias is not None, device="meta"
    )
    linear.weight = wrapped.weight  # the same Parameter: tied weights stay tied
    linear.bias = wrapped.bias
    return linear


def linear_kernel_of(model: torch.nn.Module) -> str:
    """The kernel `model`'s linear layers run on: `onednn` if any was replaced, else `torch`."""
    return "onednn" if any(isinstance(m, OneDnnLinear) for m in model.modules()) else "torch"
