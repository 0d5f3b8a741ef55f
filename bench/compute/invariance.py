"""`kvmosaic bench invariance`: does a prefill row's result depend on the rows computed with it?

A reused exact prefix, a chunk's KV from ingest and a repair's exact rows are bit for bit what
full prefill computes only if every op of the prefill path gives row i the same bits whether
it runs alone, in a block of b rows, or with all of the prompt. For each op on the prefill path
(linear layers on each kernel, in one call and in the prefill's row tiles of
engine/model/row_tiles.py; attention over the past rows, RMSNorm, RoPE, the embedding lookup,
the MLP as the model runs it) and each dtype, this computes N rows all at once, then the
same rows in blocks of b (1, 7, 16, ... rows) and counts the rows whose bits differ; and times
the op on all N rows against float32.

Weights are random, in the model's shapes (`config.json` of `--model`): the bits depend on
the shapes, the dtype and the kernel, not on the values. Attention blocks attend as the engine
makes them (`QueryLayout`): the rows [s, s + b) over keys [0, s + b), a prefix's rows or a
tail's. What it does not cover: the engine's CPU kernels (engine/cpu/) run decode only, and
their rows' bits are tested alone and with companions in tests/engine/test_decode_attention.py
and test_native_step.py.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model.attention import QueryLayout, causal_attention
from engine.model.layers import _rope
from engine.model.linear import OneDnnLinear, onednn_agrees
from engine.model.row_tiles import ROW_TILE, by_row_tiles
from engine.serving.threads import in_own_thread

BLOCKS = (1, 7, 16, 64, 128, 512, 1024)
DTYPES = (torch.float32, torch.bfloat16)
RowsFn = Callable[[int, int], torch.Tensor]
# randn(*shape, scale=1.0): a seeded normal tensor in the dtype under test
Randn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class RowOp:
    """An op of the prefill path: `rows(lo, hi)` computes rows [lo, hi) as one block."""

    name: str
    kernel: str
    rows: RowsFn


@dataclass
class Invariance:
    """One op on one kernel in one dtype: per block size, rows whose bits differ from all
    rows at once and the largest difference; per other thread count, rows whose bits differ
    from all rows at once on this thread's count; the median time of all rows at once."""

    name: str
    kernel: str
    dtype: torch.dtype
    differing: dict[int, int] = field(default_factory=dict)
    max_diff: dict[int, float] = field(default_factory=dict)
    ms: float = float("nan")
    by_threads: dict[int, int] = field(default_factory=dict)  # thread count -> rows differing

    @property
    def invariant(self) -> bool:
        return not any(self.differing.values()) and not any(self.by_threads.values())


def measure(
    op: RowOp,
    dtype: torch.dtype,
    total: int,
    blocks: Sequence[int],
    repeats: int,
    threads: Sequence[int] = (),
) -> Invariance:
    """`Invariance` of `op` over `total` rows at each block size (those under `total`) and at
    each thread count of `threads` other than this thread's."""
    with torch.inference_mode():
        whole = op.rows(0, total)
        found = Invariance(op.name, op.kernel, dtype)
        for size in (b for b in blocks if b < total):
            parts = torch.cat([op.rows(s, min(s + size, total)) for s in range(0, total, size)])
            found.differing[size] = _rows_differing(parts, whole)
            found.max_diff[size] = float((parts.float() - whole.float()).abs().max())
        for count in (t for t in threads if t != torch.get_num_threads()):
            found.by_threads[count] = _rows_differing(_on_threads(op, total, count), whole)
        found.ms = median_ms(lambda: op.rows(0, total), repeats)
    return found


def _rows_differing(rows: torch.Tensor, reference: torch.Tensor) -> int:
    same = (rows == reference).reshape(reference.shape[0], -1).all(dim=1)
    return int((~same).sum())


def _on_threads(op: RowOp, total: int, count: int) -> torch.Tensor:
    """All `total` rows of `op`, computed on a new thread that uses `count` CPU threads."""

    def rows() -> torch.Tensor:
        with torch.inference_mode():  # thread-local: the new thread enters its own
            return op.rows(0, total)

    return in_own_thread(rows, threads=count)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call set-up (oneDNN primitives, allocations) is not the op
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@dataclass(frozen=True)
class Shapes:
    """The model's shapes that the prefill ops run in."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float

    @classmethod
    def of(cls, config: Any) -> Shapes:
        """From a transformers config (Llama-family names)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        theta = getattr(config, "rope_theta", None) or (
            getattr(config, "rope_parameters", None) or {}
        ).get("rope_theta", 10000.0)
        return cls(
            config.hidden_size,
            config.intermediate_size,
            heads,
            config.num_key_value_heads,
            head_dim,
            config.vocab_size,
            float(theta),
        )


def row_ops(shapes: Shapes, dtype: torch.dtype, total: int, seed: int = 0) -> list[RowOp]:
    """Every prefill op in `dtype` over `total` random rows of the model's shapes."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x = randn(total, shapes.hidden)
    inner = randn(total, shapes.intermediate)
    ops = linear_ops(shapes, dtype, x, inner, randn)
    ops += [
        *mlp_ops(shapes, dtype, x),
        attention_op(shapes, total, randn),
        norm_op(shapes, dtype, x),
        rope_op(shapes, total, randn),
    ]
    ids = torch.randint(shapes.vocab, (total,), generator=gen)
    table = torch.nn.Embedding(shapes.vocab, shapes.hidden).to(dtype)
    ops.append(RowOp("embedding lookup", "torch", lambda lo, hi: table(ids[lo:hi])))
    return ops


def linear_ops(
    shapes: Shapes, dtype: torch.dtype, x: torch.Tensor, inner: torch.Tensor, randn: Randn
) -> list[RowOp]:
    """q/k/v-, up- and down-shaped products on each linear kernel that runs here."""
    weights = {
        "linear q_proj": (randn(shapes.heads * shapes.head_dim, shapes.hidden, scale=0.05), x),
        "linear k_proj": (randn(shapes.kv_heads * shapes.head_dim, shapes.hidden, scale=0.05), x),
        "linear up_proj": (randn(shapes.intermediate, shapes.hidden, scale=0.05), x),
        "linear down_proj": (randn(shapes.hidden, shapes.intermediate, scale=0.05), inner),
    }
    kernels = ["torch", "onednn"] if onednn_agrees(dtype) else ["torch"]
    return [
        RowOp(
            name,
            f"{kernel}, row tiles" if tiled else kernel,
            _rows_of(_linear(kernel, weight), inputs, tiled),
        )
        for name, (weight, inputs) in weights.items()
        for kernel in kernels
        for tiled in (False, True)
    ]


def _linear(kernel: str, weight: torch.Tensor) -> torch.nn.Module:
    """`nn.Linear` over `weight` (no bias) on torch's kernel or oneDNN's
    (engine/model/linear.py)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return OneDnnLinear(linear) if kernel == "onednn" else linear


def _rows_of(module: torch.nn.Module, inputs: torch.Tensor, tiled: bool = False) -> RowsFn:
    """Rows [lo, hi) of module(inputs): in one call, or in the prefill's row tiles (`tiled`,
    engine/model/row_tiles.py)."""
    return lambda lo, hi: by_row_tiles(module, inputs[lo:hi], ROW_TILE if tiled else None)


def mlp_ops(shapes: Shapes, dtype: torch.dtype, x: torch.Tensor) -> list[RowOp]:
    """The model's MLP module (gate, up, SiLU, down) on torch's linear kernel, in one call and
    in the prefill's row tiles."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=shapes.hidden, intermediate_size=shapes.intermediate)
    torch.manual_seed(0)
    mlp = LlamaMLP(config).to(dtype).eval()  # type: ignore[no-untyped-call]
    name = "MLP (gate, up, SiLU, down)"
    return [
        RowOp(name, "torch", _rows_of(mlp, x)),
        RowOp(name, "torch, row tiles", _rows_of(mlp, x, True)),
    ]


def attention_op(shapes: Shapes, total: int, randn: Randn) -> RowOp:
    """The engine's attention (`causal_attention`): rows [lo, hi) over keys [0, hi)."""
    # q: [heads, total, head_dim]; k, v: [kv_heads, total, head_dim]
    q = randn(shapes.heads, total, shapes.head_dim)
    k, v = (randn(shapes.kv_heads, total, shapes.head_dim) for _ in range(2))
    scale = shapes.head_dim**-0.5

    def rows(lo: int, hi: int) -> torch.Tensor:
        layout = QueryLayout(torch.arange(lo, hi), hi, q.dtype)
        return causal_attention(q[:, lo:hi], k[:, :hi], v[:, :hi], layout, scale)

    return RowOp("attention over past rows", "engine", rows)


def norm_op(shapes: Shapes, dtype: torch.dtype, x: torch.Tensor) -> RowOp:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(shapes.hidden).to(dtype)
    return RowOp("RMSNorm", "transformers", lambda lo, hi: norm(x[lo:hi]))


def rope_op(shapes: Shapes, total: int, randn: Randn) -> RowOp:
    """RoPE as the engine applies it: the rotary tables of the rows' positions, then `_rope`."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=shapes.heads * shapes.head_dim,
        num_attention_heads=shapes.heads,
        rope_theta=shapes.rope_theta,  # type: ignore[call-arg]
    )
    rotary = LlamaRotaryEmbedding(config)
    q = randn(shapes.heads, total, shapes.head_dim)  # [heads, total, head_dim]

    def rows(lo: int, hi: int) -> torch.Tensor:
        cos, sin = rotary(q, torch.arange(lo, hi)[None])
        return _rope(q[:, lo:hi], cos[0], sin[0]).transpose(0, 1)

    return RowOp("RoPE (tables + rotation)", "engine", rows)


def run_invariance(
    shapes: Shapes,
    total: int,
    blocks: Sequence[int] = BLOCKS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    repeats: int = 5,
    say: Callable[[str], None] = print,
    only: Sequence[str] | None = None,
    threads: Sequence[int] = (),
) -> list[Invariance]:
    """Every op (or those whose name contains one of `only`) in every dtype, at each block
    size and thread count; `say` gets a line per op as it finishes."""
    found = []
    for dtype in dtypes:
        for op in row_ops(shapes, dtype, total):
            if only is not None and not any(part in op.name for part in only):
                continue
            result = measure(op, dtype, total, blocks, repeats, threads)
            say(f"  {op.name} [{op.kernel}] {_dtype_name(dtype)}: {_verdict(result)}")
            found.append(result)
    return found


def format_table(results: Sequence[Invariance], total: int, blocks: Sequence[int]) -> str:
    """Markdown: per op, kernel and dtype, the rows (of `total`) whose bits differ from all rows
    at once at each block size and at each other thread count, the largest difference over the
    blocks, and the time against float32's."""
    sizes = [b for b in blocks if b < total]
    counts = sorted({t for r in results for t in r.by_threads})
    float32 = {(r.name, r.kernel): r.ms for r in results if r.dtype == torch.float32}
    head = ["op", "kernel", "dtype", *[f"b={b}" for b in sizes], *[f"{t} thr" for t in counts]]
    head += ["max abs diff", "ms", "vs fp32"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [_cell(r.differing[b]) for b in sizes]
        cells += [_cell(r.by_threads[t]) if t in r.by_threads else "" for t in counts]
        worst = max(r.max_diff.values(), default=0.0)
        ratio = float32.get((r.name, r.kernel), float("nan")) / r.ms
        lines.append(
            f"| {r.name} | {r.kernel} | {_dtype_name(r.dtype)} | "
            + " | ".join(cells)
            + f" | {worst:.3g} | {r.ms:.2f} | {ratio:.2f}× |"
        )
    return "\n".join(lines)


def _cell(rows: int) -> str:
    return "=" if rows == 0 else f"{rows} rows"


def _verdict(result: Invariance) -> str:
    if result.invariant:
        return f"row-invariant at every block and thread count, {result.ms:.2f} ms"
    found = []
    if bad := [b for b, n in result.differing.items() if n]:
        found.append(f"the block (b = {', '.join(map(str, bad))})")
    if bad := [t for t, n in result.by_threads.items() if n]:
        found.append(f"the thread count ({', '.join(map(str, bad))})")
    return f"bits depend on {' and '.join(found)}, {result.ms:.2f} ms"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
