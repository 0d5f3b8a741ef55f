"""`kvmosaic bench decode`: time per output token against the floor that reading the weights sets.

A decode step reads every weight of the model once, whatever the number of streams it serves,
plus each stream's KV cache. This bench times the engine's own decode step (`decode_batch`, as
the scheduler calls it, on the engine's compute thread) at several stream counts over
RAG-sized caches (the KV of demo-corpus articles after the system prefix, ~1,500 tokens, as a
full prefill computes it, cloned per stream),
and sets each figure beside the floor it implies: the weight bytes a step reads over the
memory bandwidth measured in the same run (a large `torch.sum` on the compute thread).

Two passes per stream count:
- timed: `--steps` steps (greedy tokens picked as the scheduler does), after warm-up steps,
  for `--rounds` rounds (the caches are cut back to the prompt between rounds);
- instrumented (`profile_step`): the same steps with every piece of the step timed apart
  (linear layers, attention, norms and RoPE, sampling; the rest is Python, dispatch and the
  small tensor operations between them): the PyTorch twin's modules and functions wrapped in
  timers, or the native step's own phase clocks (its thread 0's time between the team's
  barriers, so waiting for the other threads counts in the phase). Wrapping the pieces costs
  a little time of its own, so the timed pass gives the headline figures and this one the
  split.

Nothing here changes how the engine decodes; it reads the figures, so the same bench measures
any version of the decode path.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

import engine.model.decode as decode_module
import engine.model.layers as layers_module
from engine.cpu.library import cpu_signature
from engine.engine import Engine
from engine.kv import KVCache
from engine.model.decode import SamplingParams, decode_batch, pick_token
from engine.model.layers import DecoderStack
from engine.model.linear import OneDnnLinear

DEMO_CORPUS = Path(__file__).resolve().parents[2] / "app" / "demo_corpus"
PIECES = ("linear", "attention", "norms+rope", "sampling")
# the native step's phases (engine/model/native_step.py PHASES) by piece
NATIVE_PIECES = {
    "norms": "norms+rope",
    "qkv": "linear",
    "rope": "norms+rope",
    "attention": "attention",
    "o": "linear",
    "gate_up": "linear",
    "down": "linear",
    "lm_head": "linear",
}
BANDWIDTH_BYTES = 256 * 2**20  # big enough to leave the caches far behind


@dataclass
class StreamFigures:
    """One stream count: every timed step, and the instrumented pass's mean split per step."""

    streams: int
    step_s: list[float]
    split_s: dict[str, float] = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def min_s(self) -> float:
        return min(self.step_s)


@dataclass
class DecodeFigures:
    """A run: what was measured, the floor's inputs, and the figures per stream count."""

    label: str
    context_tokens: int
    weight_bytes: int
    kv_bytes_per_stream: int
    bandwidth: list[float]  # bytes/s, one per repeat
    streams: list[StreamFigures]

    @property
    def bandwidth_median(self) -> float:
        return statistics.median(self.bandwidth)

    def floor_s(self, streams: int = 0) -> float:
        """The weights' floor (streams 0), or weights and the KV of `streams` streams."""
        return (self.weight_bytes + streams * self.kv_bytes_per_stream) / self.bandwidth_median


def corpus_cache(engine: Engine, tokens: int) -> tuple[KVCache, int]:
    """The KV of [system prefix][demo-corpus articles, in file order, cut at `tokens` tokens],
    as a full prefill computes it (the articles as one chunk right after the prefix), and the
    last token, which the first step decodes."""
    ids: list[int] = []
    for path in sorted(DEMO_CORPUS.glob("*.md")):
        ids += engine.chunk_ids(path.read_text())
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    prefix, text = engine.prefix_kv.kv, engine.encode_chunk(ids[:-1]).kv
    cache = KVCache(
        prefix.shape[0],
        prefix.shape[2],
        prefix.shape[4],
        prefix.shape[3] + text.shape[3],
        prefix.dtype,
        prefix.device,
    )
    cache.data.copy_(torch.cat([prefix, text], dim=3))
    cache.length = cache.capacity
    return cache, ids[-1]


def decode_weight_bytes(stack: DecoderStack) -> int:
    """Bytes of the weights one decode step reads: every linear layer and lm_head (each tensor
    once, tied ones too), and the norms; the embedding table only where lm_head is it. The
    native step counts its own (its weights may be a smaller copy)."""
    if stack.native is not None:
        return stack.native.weight_bytes
    modules = [*stack.layers, stack.final_norm, stack.lm_head]
    tensors = {id(p): p for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in tensors.values())


def kv_bytes(cache: KVCache) -> int:
    """Bytes of K and V a step reads for one stream of this cache (every layer's rows)."""
    per_row = cache.data[:, :, :, 0].numel() * cache.data.element_size()
    return per_row * cache.length


def measure_bandwidth(repeats: int = 7) -> list[float]:
    """Bytes/s of a `torch.sum` over BANDWIDTH_BYTES on this thread's torch threads."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    data.sum()  # first touch
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        rates.append(BANDWIDTH_BYTES / (time.perf_counter() - started))
    return rates


def step_once(
    stack: DecoderStack,
    caches: Sequence[KVCache],
    tokens: list[int],
    engine: Engine,
    sampling: Callable[[torch.Tensor], int],
) -> list[int]:
    """One decode step for every stream, as the scheduler runs it; the next tokens."""
    logits = decode_batch(
        stack,
        caches,
        tokens,
        invariant=engine.config.batch_invariant,
        max_rows=engine.config.max_batch,
    )
    return [sampling(row) for row in logits]


def greedy(row: torch.Tensor) -> int:
    return pick_token(row, SamplingParams(), None)


def timed_steps(
    stack: DecoderStack,
    engine: Engine,
    prompt: KVCache,
    first: int,
    streams: int,
    steps: int,
    rounds: int,
    warmup: int,
    sampling: Callable[[torch.Tensor], int] = greedy,
) -> list[float]:
    """Seconds of every step of `rounds` rounds of `steps` steps (after `warmup` untimed)."""
    caches = [prompt.copy(prompt.length + warmup + steps + 1) for _ in range(streams)]
    times = []
    for _ in range(rounds):
        for cache in caches:
            cache.length = prompt.length
        tokens = [first] * streams
        for step in range(warmup + steps):
            started = time.perf_counter()
            tokens = step_once(stack, caches, tokens, engine, sampling)
            if step >= warmup:
                times.append(time.perf_counter() - started)
    return times


class PieceTimer:
    """Adds the time spent inside wrapped callables to their piece's total."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PIECES, 0.0)

    def wrap(self, piece: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[piece] += time.perf_counter() - started

        return timed


@contextmanager
def instrumented(stack: DecoderStack, timer: PieceTimer) -> Iterator[None]:
    """Time the pieces of a torch decode step: the model's linear and norm modules, RoPE and
    the step's attention (the stack's own callables, wrapped for the duration)."""
    with ExitStack() as undo:
        for module in _modules(stack):
            if isinstance(module, (torch.nn.Linear, OneDnnLinear)):
                _patch(undo, module, "forward", timer.wrap("linear", module.forward))
            elif type(module).__name__.endswith("RMSNorm"):
                _patch(undo, module, "forward", timer.wrap("norms+rope", module.forward))
        _patch(undo, layers_module, "_rope", timer.wrap("norms+rope", layers_module._rope))
        _patch(undo, stack, "rope_tables", timer.wrap("norms+rope", stack.rope_tables))
        step_attention = vars(decode_module)["step_attention"]

        def timed_attention(*args: Any, **kwargs: Any) -> Any:
            return timer.wrap("attention", step_attention(*args, **kwargs))

        _patch(undo, decode_module, "step_attention", timed_attention)
        yield


def _modules(stack: DecoderStack) -> Iterator[torch.nn.Module]:
    for part in [*stack.layers, stack.final_norm, stack.lm_head]:
        if isinstance(part, torch.nn.Module):
            yield from part.modules()


def _patch(undo: ExitStack, owner: object, name: str, value: object) -> None:
    had = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    undo.callback(lambda: setattr(owner, name, old) if had else delattr(owner, name))


def profile_step(
    stack: DecoderStack,
    engine: Engine,
    prompt: KVCache,
    first: int,
    streams: int,
    steps: int,
) -> dict[str, float]:
    """Mean seconds per step of each piece, and `total` and `python+dispatch` (the rest)."""
    timer = PieceTimer()
    sampling = timer.wrap("sampling", greedy)
    native, phases = stack.native, dict[str, float]()
    if native is not None:
        native.profile = phases
    try:
        with instrumented(stack, timer):  # warm already: the timed pass ran just before
            times = timed_steps(stack, engine, prompt, first, streams, steps, 1, 0, sampling)
    finally:
        if native is not None:
            native.profile = None
    split = {piece: timer.seconds[piece] / len(times) for piece in PIECES}
    for phase, seconds in phases.items():  # the native step times its own phases
        split[NATIVE_PIECES[phase]] += seconds / len(times)
    split["total"] = statistics.mean(times)
    split["python+dispatch"] = split["total"] - sum(split[p] for p in PIECES)
    return split


def variant_stacks(engine: Engine, weights: Sequence[str]) -> dict[str, DecoderStack]:
    """A stack on the engine's model per decode weights mode (`DecoderStack(..., weights)`, with
    the rounded weights measured for the model, which `auto` may take), and for `twin` one whose
    native step is off: the PyTorch step (with the engine's attention)."""
    stacks = {}
    own = engine.stack
    for name in weights:
        if name == "twin":
            stack = DecoderStack(engine.loaded, own.decode_attention)
            stack.native_unfit = "off for the bench: the twin"
        else:
            stack = DecoderStack(
                engine.loaded, own.decode_attention, name, own.rounded_decode_weights
            )
        stacks[name] = stack
    return stacks


def run_decode_bench(
    engine: Engine,
    streams: Sequence[int] = (1, 2, 4, 8),
    context: int = 1500,
    steps: int = 32,
    rounds: int = 3,
    warmup: int = 3,
    profile: bool = True,
    stacks: dict[str, DecoderStack] | None = None,
) -> list[DecodeFigures]:
    """The figures of each stack (default: the engine's own), on the engine's compute thread."""
    prompt, first = corpus_cache(engine, context)

    def run(label: str, stack: DecoderStack) -> DecodeFigures:
        figures = []
        for count in streams:
            times = timed_steps(stack, engine, prompt, first, count, steps, rounds, warmup)
            split = profile_step(stack, engine, prompt, first, count, steps) if profile else {}
            figures.append(StreamFigures(count, times, split))
        return DecodeFigures(
            label,
            prompt.length,
            decode_weight_bytes(stack),
            kv_bytes(prompt),
            measure_bandwidth(),
            figures,
        )

    chosen = stacks or {"engine": engine.stack}
    return [engine.compute(partial(run, label, stack)) for label, stack in chosen.items()]


def cpu_name() -> str:
    """The CPU's model name and core count, for the report's first line."""
    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpu_signature().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    return f"{name}, {os.cpu_count()} CPUs"


def format_report(figures: DecodeFigures) -> str:
    """The table of one run: per stream count the step time, per-token time, the floors and
    the ratios, then the profile split."""
    bw = figures.bandwidth_median
    lines = [
        f"{figures.label}: cache {figures.context_tokens:,} tokens per stream; weights "
        f"{figures.weight_bytes / 1e6:,.0f} MB per step, KV "
        f"{figures.kv_bytes_per_stream / 1e6:,.0f} MB per stream; bandwidth {bw / 1e9:.1f} GB/s "
        f"(median of {len(figures.bandwidth)}, "
        f"max {max(figures.bandwidth) / 1e9:.1f}): floor {figures.floor_s() * 1e3:.1f} ms per "
        "step (weights)",
        "| streams | step ms (median / min) | ms per token | tokens/s | step / weights floor "
        "| step / (weights + KV) floor | step / 1-stream step |",
        "|---|---|---|---|---|---|---|",
    ]
    one = figures.streams[0].median_s
    for s in figures.streams:
        lines.append(
            f"| {s.streams} | {s.median_s * 1e3:.1f} / {s.min_s * 1e3:.1f} | "
            f"{s.median_s * 1e3 / s.streams:.1f} | {s.streams / s.median_s:.1f} | "
            f"{s.median_s / figures.floor_s():.2f}x | "
            f"{s.median_s / figures.floor_s(s.streams):.2f}x | {s.median_s / one:.2f}x |"
        )
    if any(s.split_s for s in figures.streams):
        parts = (*PIECES, "python+dispatch", "total")
        lines += [
            "",
            "profile split, ms per step (instrumented pass)",
            "| streams | " + " | ".join(parts) + " |",
            "|---" * (len(parts) + 1) + "|",
        ]
        for s in figures.streams:
            lines.append(
                f"| {s.streams} | " + " | ".join(f"{s.split_s[p] * 1e3:.1f}" for p in parts) + " |"
            )
    return "\n".join(lines)


def format_summary(runs: Sequence[DecodeFigures]) -> str:
    """One line per run: each stream count's step, the one-stream step over the run's own floor
    (its weights' bytes over the bandwidth measured in the run), and the four-stream step over
    the one-stream step (each stream gets one token per step)."""
    counts = [s.streams for s in runs[0].streams]
    head = " | ".join(f"{n} stream{'s' * (n > 1)} ms" for n in counts)
    lines = [
        f"| weights | MB per step | {head} | 1 stream / weights floor | per-stream step at 4 "
        "/ at 1 |",
        "|---" * (len(counts) + 4) + "|",
    ]
    for figures in runs:
        steps = {s.streams: s.median_s for s in figures.streams}
        four = f"{steps[4] / steps[1]:.2f}x" if 4 in steps and 1 in steps else "-"
        one = f"{steps[1] / figures.floor_s():.2f}x" if 1 in steps else "-"
        lines.append(
            f"| {figures.label} | {figures.weight_bytes / 1e6:,.0f} | "
            + " | ".join(f"{steps[n] * 1e3:.1f}" for n in counts)
            + f" | {one} | {four} |"
        )
    return "\n".join(lines)


def figures_json(figures: DecodeFigures) -> dict[str, Any]:
    return {
        "label": figures.label,
        "context_tokens": figures.context_tokens,
        "weight_bytes": figures.weight_bytes,
        "kv_bytes_per_stream": figures.kv_bytes_per_stream,
        "bandwidth": figures.bandwidth,
        "floor_s": figures.floor_s(),
        "streams": [
            {"streams": s.streams, "step_s": s.step_s, "split_s": s.split_s}
            for s in figures.streams
        ],
    }
