"""`kvmosaic bench kernels`: each CUDA kernel against its PyTorch eager twin, same inputs.

Inputs are one layer of a RAG prompt as the runner sees it: a cache
`[layers, 2, kv_heads, capacity, head_dim]`, chunks of `chunk_tokens` rows, `ratio` of the
context selected at the check layer. A call's time is the mean over `repeats` back-to-back
calls (after warm-up) measured with CUDA events, Python and launch overhead included, since
that is what the engine pays. `speedup` is twin time / kernel time; `max_diff` the largest
absolute difference of their outputs. On `--device cpu` the "kernel" is the library's host
twin: a smoke test of this module, not a measurement.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import kernels
from engine.kernels import launch
from engine.kernels.library import Library
from engine.model import ops


@dataclass(frozen=True)
class KernelBenchOptions:
    device: str = "cuda"
    dtype: torch.dtype = torch.float16
    layers: int = 30
    kv_heads: int = 3  # SmolLM2-135M
    head_dim: int = 64
    tokens: int = 1536  # prompt rows
    chunk_tokens: int = 256
    ratio: float = 0.15
    repeats: int = 200
    warmup: int = 20


@dataclass
class KernelTiming:
    op: str
    kernel_us: float
    twin_us: float
    speedup: float
    max_diff: float


@dataclass
class _Case:
    """Zero-argument calls of the kernel and of the twin, each returning its output."""

    op: str
    kernel: Callable[[], torch.Tensor]
    twin: Callable[[], torch.Tensor]


def run_kernel_bench(
    options: KernelBenchOptions, library: Library | None = None
) -> list[KernelTiming]:
    library = library or _require_library()
    cache, cases = _cases(options, library)
    return [_measure(case, cache, options) for case in cases]


def _require_library() -> Library:
    if kernels.mode() == "off":
        raise kernels.KernelError("KVMOSAIC_KERNELS=off: nothing to benchmark")
    found = kernels.get()
    if found is None:
        raise kernels.KernelError("the kernel library is unavailable (see the warning above)")
    return found


def _cases(o: KernelBenchOptions, library: Library) -> tuple[torch.Tensor, list[_Case]]:
    """The cache every case reads or writes, and the cases."""
    generator = torch.Generator(device=o.device).manual_seed(0)
    capacity = o.tokens + 64
    cache = torch.randn(
        o.layers, 2, o.kv_heads, capacity, o.head_dim, device=o.device, generator=generator
    ).to(o.dtype)
    layer = cache[o.layers // 2]  # [2, kv_heads, capacity, head_dim]
    chunk = layer[0, :, 64 : 64 + o.chunk_tokens]  # K of one chunk, a strided view
    inv_freq = 1.0 / 1e5 ** (
        torch.arange(0, o.head_dim, 2, device=o.device, dtype=torch.float32) / o.head_dim
    )
    row_delta = torch.randint(-500, 500, (o.tokens,), device=o.device, generator=generator)
    active = torch.arange(o.tokens, device=o.device)
    fresh = torch.randn(o.tokens, o.kv_heads, o.head_dim, device=o.device, generator=generator).to(
        o.dtype
    )
    fresh = fresh.transpose(0, 1)  # [kv_heads, tokens, head_dim] as project_kv returns it
    eligible = torch.rand(o.tokens, device=o.device, generator=generator) < 0.9
    scores = ops.kv_deviation_twin(fresh, layer[1, :, : o.tokens])
    count = int(o.ratio * o.tokens)
    selected = ops.top_rows_twin(scores, count, eligible)
    src = fresh[:, : selected.numel()]
    return cache, [
        _Case(
            "rope_shift (chunk, one delta)",
            lambda: launch.rope_shift_(library, chunk, 37, inv_freq),
            lambda: ops.rope_shift_twin_(chunk, 37, inv_freq),
        ),
        _Case(
            "rope_shift (prompt, per-row delta)",
            lambda: launch.rope_shift_(library, layer[0, :, : o.tokens], row_delta, inv_freq),
            lambda: ops.rope_shift_twin_(layer[0, :, : o.tokens], row_delta, inv_freq),
        ),
        _Case(
            "kv_deviation",
            lambda: launch.kv_deviation(library, fresh, layer[1, :, : o.tokens]),
            lambda: ops.kv_deviation_twin(fresh, layer[1, :, : o.tokens]),
        ),
        _Case(
            "top_rows",
            lambda: launch.top_rows(library, scores, count, eligible),
            lambda: ops.top_rows_twin(scores, count, eligible),
        ),
        _Case(
            "deviation_top_rows",
            lambda: launch.top_rows(
                library,
                launch.kv_deviation(library, fresh, layer[1, :, : o.tokens]),
                count,
                eligible,
            ),
            lambda: ops.top_rows_twin(
                ops.kv_deviation_twin(fresh, layer[1, :, : o.tokens]), count, eligible
            ),
        ),
        _Case(
            "gather_rows (layer K+V)",
            lambda: launch.gather_rows(library, layer, active),
            lambda: ops.gather_rows_twin(layer, active),
        ),
        _Case(
            "scatter_rows (selected K)",
            lambda: launch.scatter_rows_(library, layer[0], selected, src),
            lambda: ops.scatter_rows_twin_(layer[0], selected, src),
        ),
    ]


def _measure(case: _Case, cache: torch.Tensor, o: KernelBenchOptions) -> KernelTiming:
    max_diff = _max_diff(case, cache)
    kernel_us = _time_us(case.kernel, o)
    twin_us = _time_us(case.twin, o)
    return KernelTiming(
        case.op,
        kernel_us,
        twin_us,
        twin_us / kernel_us if kernel_us > 0 else float("nan"),
        max_diff,
    )


def _max_diff(case: _Case, cache: torch.Tensor) -> float:
    """Kernel and twin from the same cache contents (the in-place ops write into it)."""
    saved = cache.clone()
    got = case.kernel().clone()
    cache.copy_(saved)
    expected = case.twin()
    return float((got.double() - expected.double()).abs().max()) if got.numel() else 0.0


def _time_us(call: Callable[[], torch.Tensor], o: KernelBenchOptions) -> float:
    for _ in range(o.warmup):
        call()
    if o.device.startswith("cuda"):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves Event's __init__ unannotated
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        for _ in range(o.repeats):
            call()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) * 1000.0 / o.repeats
    started = time.perf_counter()
    for _ in range(o.repeats):
        call()
    return (time.perf_counter() - started) * 1e6 / o.repeats


def format_table(timings: list[KernelTiming]) -> str:
    lines = [f"{'op':36} {'kernel us':>10} {'twin us':>10} {'speedup':>8} {'max diff':>10}"]
    lines += [
        f"{t.op:36} {t.kernel_us:10.1f} {t.twin_us:10.1f} {t.speedup:7.2f}x {t.max_diff:10.2e}"
        for t in timings
    ]
    return "\n".join(lines)


def write_json(timings: list[KernelTiming], options: KernelBenchOptions, path: Path) -> None:
    settings = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in asdict(options).items()}
    payload = {
        "options": settings,
        "device_name": _device_name(options.device),
        "timings": [asdict(t) for t in timings],
    }
    Path(path).write_text(json.dumps(payload, indent=2))


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
