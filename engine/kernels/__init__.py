"""The CUDA kernels of `engine/csrc/`: build (nvcc, cached), load (ctypes) and launch.

`engine/model/ops.py` is the only caller in the engine: it asks `for_tensor(x)` for the library
and, when it gets one and `launch.supports_*` accepts the call, runs the kernel; otherwise
it runs the PyTorch twin. Nothing here imports torch's CUDA extension machinery, so this
package imports and its host twins run on a CPU-only torch.
"""

from __future__ import annotations

import torch

from engine.kernels import launch
from engine.kernels.library import KernelError, Library, get, mode, reset

__all__ = ["KernelError", "Library", "for_tensor", "get", "launch", "mode", "reset"]


def for_tensor(x: torch.Tensor) -> Library | None:
    """The kernel library if `x` is on a GPU and the kernels are enabled and loadable."""
    if not x.is_cuda:
        return None
    return get()
