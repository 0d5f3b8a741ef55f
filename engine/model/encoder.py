"""`ChunkEncoder`: the base-variant KV of many chunks at once, packed into one pass.

Each chunk's base variant is its KV computed alone right after the system prefix (positions
P .. P+n-1). Encoding chunks one by one runs the decoder once per chunk; here the chunks of
a batch are packed row after row into one [rows, hidden] pass, so every row-wise step (norms,
q/k/v/o projections, MLP) runs once per layer over all of them as one large matrix product,
and only attention runs per chunk: chunk i's rows attend to the system prefix's cached KV and
to its own earlier rows (the exact causal mask of `engine.model.attention`), never to another
chunk. The result equals `Engine.encode_chunk` of each chunk to float rounding.

It knows nothing of storage or of the catalog; batching by a token budget is its only policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from engine.kv import ChunkKV
from engine.model.attention import QueryLayout, causal_attention
from engine.model.layers import DecoderStack

# Rows packed into one pass. Larger passes make larger matrix products (faster per row on
# CPUs) but hold [rows, intermediate] activations; 2048 rows of SmolLM2 is ~15 MB.
DEFAULT_BATCH_TOKENS = 2048


class ChunkEncoder:
    """Packs chunks after a shared, already computed system prefix."""

    def __init__(
        self,
        stack: DecoderStack,
        prefix_kv: ChunkKV,
        fingerprint: str,
        prefix_digest: str,
        pause_point: Callable[[], None] | None = None,
    ):
        self.stack = stack
        # called between two layers, where other work may run (as `LayerRunner.pause_point`)
        self.pause_point = pause_point
        self.prefix_kv = prefix_kv  # kv: [layers, 2, kv_heads, P, head_dim]
        self.prefix_len = prefix_kv.num_tokens
        self.fingerprint, self.prefix_digest = fingerprint, prefix_digest

    def encode(
        self, chunks: Sequence[tuple[int, ...]], batch_tokens: int = DEFAULT_BATCH_TOKENS
    ) -> list[ChunkKV]:
        """Every chunk's base variant, in order. Chunks must be non-empty (the caller checks
        lengths against the model's context)."""
        out: list[ChunkKV] = []
        with torch.inference_mode():
            for batch in batches([len(c) for c in chunks], batch_tokens):
                out.extend(self._encode_packed([tuple(chunks[i]) for i in batch]))
        return out

    def _encode_packed(self, chunks: list[tuple[int, ...]]) -> list[ChunkKV]:
        stack, spec, p = self.stack, self.stack.spec, self.prefix_len
        device = stack.embed_tokens.weight.device
        lengths = [len(c) for c in chunks]
        # chunk i: rows [bounds[i], bounds[i+1])
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        ids = torch.tensor([t for c in chunks for t in c], device=device)
        positions = torch.cat([torch.arange(p, p + n, device=device) for n in lengths])
        hidden = stack.embed(ids)  # [rows, hidden]
        cos, sin = stack.rope_tables(positions, hidden)
        layouts = {
            n: QueryLayout(torch.arange(p, p + n, device=device), p + n, hidden.dtype)
            for n in set(lengths)
        }
        # kv: [layers, 2, kv_heads, rows, head_dim], every chunk's rows side by side
        kv = hidden.new_empty(spec.num_layers, 2, spec.num_kv_heads, ids.numel(), spec.head_dim)
        for layer in range(spec.num_layers):
            x = stack.input_norm(layer, hidden)
            k, v = stack.project_kv(layer, x, cos, sin)  # [kv_heads, rows, head_dim]
            kv[layer, 0], kv[layer, 1] = k, v
            if layer == spec.num_layers - 1:
                break  # the last layer's attention and MLP feed no KV: skip them (~3% of a pass)
            q = stack.project_q(layer, x, cos, sin)  # [heads, rows, head_dim]
            prefix = self.prefix_kv.layer(layer)  # [2, kv_heads, P, head_dim]
            attn = torch.cat(
                [
                    self._attend(q, k, v, prefix, start, end, layouts[end - start])
                    # [rows, heads * head_dim]
                    for start, end in zip(bounds[:-1], bounds[1:])
                ]
            )
            hidden = stack.finish_layer(layer, hidden, attn)
            if self.pause_point is not None:
                self.pause_point()
        return [
            ChunkKV(
                chunk, kv[:, :, :, start:end].contiguous(), p, self.fingerprint, self.prefix_digest
            )
            for chunk, start, end in zip(chunks, bounds[:-1], bounds[1:])
        ]

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix: torch.Tensor,
        start: int,
        end: int,
        layout: QueryLayout,
    ) -> torch.Tensor:
        """Chunk rows [start, end) over the prefix's keys and their own: [n, heads * head_dim]."""
        keys = torch.cat([prefix[0], k[:, start:end]], dim=1)  # [kv_heads, P + n, head_dim]
        values = torch.cat([prefix[1], v[:, start:end]], dim=1)
        return causal_attention(q[:, start:end], keys, values, layout, self.stack.scale)


def batches(lengths: Sequence[int], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of consecutive chunks, grouped so each group's tokens stay within
    `batch_tokens` (a longer chunk forms a group of its own)."""
    if batch_tokens < 1:
        raise ValueError("batch_tokens must be >= 1")
    group: list[int] = []
    total = 0
    for index, n in enumerate(lengths):
        if group and total + n > batch_tokens:
            yield group
            group, total = [], 0
        group.append(index)
        total += n
    if group:
        yield group
