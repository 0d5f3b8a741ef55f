"""`kvmosaic bench prefill`: full prefill's tokens/s per model, dtype and length, beside its floor.

Full prefill is the engine's layer loop (`LayerRunner`) over every row of a prompt of N random
token ids, as `full` runs it. Next to its tokens/s this prints the compute floor measured in the
same run: the prefill's arithmetic (`bench/fidelity/flops.py`, from the model's shapes) at the
machine's GEMM peak in that dtype (the best of a few large products on each linear kernel), so
`of peak` says how much of the machine the prefill uses; and llama.cpp's `llama-bench` prompt
processing (pp) on the model's GGUF where `llama-bench` is on PATH.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from bench.fidelity.flops import FlopCounter
from engine.model.layers import DecoderStack
from engine.model.linear import OneDnnLinear, onednn_agrees
from engine.model.runner import LayerRunner
from engine.plan import Plan

# (rows, inner, outer) of the products whose best speed is the GEMM peak
PEAK_SHAPES = ((2048, 2048, 2048), (2048, 896, 4864), (2048, 4864, 896))


@dataclass(frozen=True)
class PrefillFigures:
    """One model in one dtype at one prompt length."""

    model: str
    dtype: str
    tokens: int
    seconds: float  # median of the timed runs
    flops: float  # the prefill's arithmetic
    peak_flops: float  # the GEMM peak in this dtype, this run (FLOP/s)
    llama_bench: float | None  # llama-bench pp tokens/s; None: not run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def of_peak(self) -> float:
        return self.flops / self.seconds / self.peak_flops

    @property
    def floor_tokens_per_s(self) -> float:
        return self.tokens * self.peak_flops / self.flops


def full_prefill(stack: DecoderStack, tokens: int, seed: int = 0) -> Callable[[], None]:
    """A call that runs full prefill of `tokens` random ids through the engine's layer loop."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(stack.spec.vocab_size, (tokens,), generator=generator)
    plan = Plan(
        cached_spans=[],
        initial_active=torch.arange(tokens),
        pinned=torch.ones(tokens, dtype=torch.bool),
    )
    runner = LayerRunner(stack)

    def run() -> None:
        with torch.inference_mode():
            runner.run(ids, plan, tokens)

    return run


def prefill_flops(stack: DecoderStack, tokens: int) -> float:
    """Arithmetic of a full prefill of `tokens` rows (every row through every layer)."""
    counter = FlopCounter(stack.model, stack.spec.num_heads, stack.spec.head_dim)
    return counter.prefill(torch.full((tokens,), stack.spec.num_layers))


def gemm_peak(dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `PEAK_SHAPES` on any linear kernel that runs `dtype` here."""
    best = 0.0
    for rows, inner, outer in PEAK_SHAPES:
        x = torch.randn(rows, inner).to(dtype)
        linear = torch.nn.Linear(inner, outer, bias=False).to(dtype).requires_grad_(False)
        kernels: list[torch.nn.Module] = [linear]
        if onednn_agrees(dtype):
            kernels.append(OneDnnLinear(linear))
        for kernel in kernels:
            with torch.inference_mode():
                seconds = min_seconds(partial(kernel, x), repeats)
            best = max(best, 2 * rows * inner * outer / seconds)
    return best


def min_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls after one warm-up (a peak is the machine at its best)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def llama_bench_pp(gguf: Path | None, tokens: int) -> float | None:
    """llama-bench's prompt-processing tokens/s on `gguf` for `tokens`; None without the tool or
    a GGUF of the model."""
    tool = shutil.which("llama-bench")
    if tool is None or gguf is None:
        return None
    out = subprocess.run(
        [tool, "-m", str(gguf), "-p", str(tokens), "-n", "0", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"]) if rows else None


def llama_bench_status(gguf: Path | None) -> str:
    tool = shutil.which("llama-bench")
    if tool is None:
        return "llama-bench: not installed"
    return f"llama-bench: {tool}" + ("" if gguf else " (no GGUF of the model)")


def measure_model(
    name: str,
    dtype: str,
    stack: DecoderStack,
    lengths: Sequence[int],
    repeats: int,
    gguf: Path | None,
    say: Callable[[str], None] = print,
) -> list[PrefillFigures]:
    """Full prefill of one loaded model at each length, with the GEMM peak of its dtype."""
    peak = gemm_peak(stack.model_dtype)
    say(f"{name} {dtype}: GEMM peak {peak / 1e9:.1f} GFLOP/s")
    full_prefill(stack, min(lengths))()  # warm-up: first-call set-up is not prefill
    found = []
    for tokens in lengths:
        seconds = median_seconds(full_prefill(stack, tokens), repeats)
        figures = PrefillFigures(
            name,
            dtype,
            tokens,
            seconds,
            prefill_flops(stack, tokens),
            peak,
            llama_bench_pp(gguf if dtype == "float32" else None, tokens),
        )
        say(f"  {tokens} tokens: {seconds:.2f} s, {figures.tokens_per_s:.0f} tokens/s")
        found.append(figures)
    return found


def format_table(rows: Sequence[PrefillFigures]) -> str:
    """Markdown: tokens/s against the floor at the GEMM peak, and llama-bench's pp."""
    head = (
        "| model | dtype | tokens | seconds | tokens/s | GFLOP | GEMM peak GFLOP/s | of peak "
        "| floor tokens/s | llama-bench pp tokens/s |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        pp = f"{r.llama_bench:.0f}" if r.llama_bench is not None else "–"
        lines.append(
            f"| {r.model} | {r.dtype} | {r.tokens} | {r.seconds:.2f} | {r.tokens_per_s:.0f} | "
            f"{r.flops / 1e9:.0f} | {r.peak_flops / 1e9:.1f} | {r.of_peak:.0%} | "
            f"{r.floor_tokens_per_s:.0f} | {pp} |"
        )
    return "\n".join(lines)
