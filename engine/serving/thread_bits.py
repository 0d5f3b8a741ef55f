"""Whether a prefill's bits depend on how many CPU threads compute it.

A chunk's KV is exact only if it is, bit for bit, what full prefill of the same prompt computes.
Full prefill runs on the compute thread's count; the variant builder runs on one thread so as
not to slow it (engine/serving/threads.py), and a replica sized otherwise may share the store.
Some matrix libraries split a product's work, and with it a row's sum, by the thread count (MKL
and oneDNN on an Intel Xeon with AMX: docs/benchmarks/bfloat16.md, "Row tiles"); others do not
(an AMD EPYC, Zen 3). So at load the engine computes one prefill tile of every product shape and
of attention on one thread and on its own count, and compares the bits (`threads_change_bits`).

Comparing with one thread makes the answer transitive: two processes whose counts both give one
thread's bits give each other's, so only a count whose bits differ from one thread's joins the
fingerprint (`thread_fingerprint`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from engine.model.attention import QueryLayout, causal_attention
from engine.model.row_tiles import ROW_TILE
from engine.serving.row_bits import first_layer_linears
from engine.serving.threads import in_own_thread

ProbeFn = Callable[[], list[torch.Tensor]]


def threads_change_bits(model: PreTrainedModel, threads: int) -> bool:
    """Whether `model`'s prefill products (one row tile of each of its first decoder layer's
    linear layers, as installed) or a tile of attention give other bits on `threads` CPU threads
    than on one. False on other devices and for one thread (nothing to compare)."""
    if threads <= 1 or next(model.parameters()).device.type != "cpu":
        return False
    probe = _probe(model)
    return not all(
        torch.equal(a, b)
        for a, b in zip(in_own_thread(probe, threads=1), in_own_thread(probe, threads=threads))
    )


def thread_fingerprint(fingerprint: str, threads: int) -> str:
    """A model fingerprint that also names the thread count: KV whose bits depend on it is
    another cache for each count."""
    text = f"{fingerprint} threads {threads}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _probe(model: PreTrainedModel) -> ProbeFn:
    """A function computing one tile of every distinct linear shape of the first decoder layer
    and one tile of attention over two tiles of keys, on seeded inputs."""
    linears = first_layer_linears(model)
    config = model.config
    dtype = next(model.parameters()).dtype
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    def compute() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        with torch.inference_mode():
            outs = [linear(randn(ROW_TILE, inputs)) for (inputs, _), linear in linears.items()]
            q = randn(heads, ROW_TILE, head_dim)
            k, v = (randn(kv_heads, 2 * ROW_TILE, head_dim) for _ in range(2))
            layout = QueryLayout(torch.arange(ROW_TILE, 2 * ROW_TILE), 2 * ROW_TILE, dtype)
            outs.append(causal_attention(q, k, v, layout, head_dim**-0.5))
        return outs

    return compute
