"""Attention of a set of query rows over the cache with an exact causal mask by position.

A query at absolute position p sees exactly the keys at positions <= p, wherever the query
sits in the prompt: a recomputed token in the middle of the context never sees later chunks.
(Public CacheBlend code uses a bottom-right mask that lets interior tokens see later keys;
see LMCache issue 1152.)

The active rows of a request change only at a planner's selecting layers, so the way they
attend (`QueryLayout`: blocks and their masks) is built once per active set and reused by
every layer until the next selection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Queries per block when the query rows are scattered. Each block attends to the keys up to
# its last query's position, so cost follows the causal triangle while a block stays large
# enough for the kernel to be efficient (measured on CPU: 64-128 rows per block are best).
QUERY_BLOCK = 96


class QueryLayout:
    """How query rows at positions q_pos attend to keys 0..num_keys-1; built once, reused.

    q_pos: [m] strictly increasing positions, all < num_keys. Three shapes:
    - the rows are a tail [s, num_keys) with s <= num_keys / 2: pad the missing head rows and
      run the plain causal kernel (cheaper than masking; the padded rows are discarded);
    - a single row at the last position: no mask at all (decode);
    - otherwise blocks of QUERY_BLOCK rows, each with an additive mask [rows, block_end].
    """

    def __init__(self, q_pos: torch.Tensor, num_keys: int, dtype: torch.dtype):
        self.num_rows = q_pos.numel()
        self.num_keys = num_keys
        first, last = int(q_pos[0]), int(q_pos[-1])
        is_tail = last == num_keys - 1 and last - first == self.num_rows - 1
        self.pad = first if is_tail and first <= num_keys // 2 else None
        self.blocks: list[tuple[int, int, int, torch.Tensor | None]] = []
        if self.pad is None:
            for start in range(0, self.num_rows, QUERY_BLOCK):
                rows = q_pos[start:start + QUERY_BLOCK]
                self.blocks.append((start, start + rows.numel(), int(rows[-1]) + 1, _block_mask(rows, dtype)))


def _block_mask(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask [len(rows), rows[-1] + 1]: 0 where key position <= query position, -inf above."""
    if rows.numel() == 1:  # one query sees every key up to itself
        return None
    end = int(rows[-1]) + 1
    hidden = torch.arange(end, device=rows.device)[None, :] > rows[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=rows.device).masked_fill_(hidden, float("-inf"))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: QueryLayout,
                     scale: float) -> torch.Tensor:
    """Attention output of the layout's query rows. Returns [m, heads * head_dim].

    q: [heads, m, head_dim]; k, v: [kv_heads, num_keys, head_dim] (grouped-query heads allowed).
    """
    gqa = q.shape[0] != k.shape[0]
    if layout.pad is not None:
        out = _padded_causal(q, k, v, layout.pad, scale, gqa)
    else:
        out = torch.cat([
            F.scaled_dot_product_attention(q[None, :, start:stop], k[None, :, :end], v[None, :, :end],
                                           attn_mask=mask, scale=scale, enable_gqa=gqa)[0]
            for start, stop, end, mask in layout.blocks], dim=1)
    return out.transpose(0, 1).reshape(layout.num_rows, -1)


def _padded_causal(q, k, v, pad: int, scale: float, gqa: bool) -> torch.Tensor:
    if pad:
        q = torch.cat([q.new_zeros(q.shape[0], pad, q.shape[2]), q], dim=1)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa)[0]
    return out[:, pad:]


def attention_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float,
                   block: int = 128) -> torch.Tensor:
    """Attention probability on every key, averaged over heads and query rows: [num_keys].

    q: [heads, m, head_dim]; k: [kv_heads, num_keys, head_dim]; q_pos: [m] ascending.
    Scores are formed in blocks of query rows so memory stays [heads, block, num_keys].
    """
    group = q.shape[0] // k.shape[0]
    keys = k.float().repeat_interleave(group, 0)  # [heads, n, head_dim]
    key_pos = torch.arange(k.shape[1], device=k.device)
    total = torch.zeros(k.shape[1], dtype=torch.float32, device=k.device)
    for start in range(0, q.shape[1], block):
        rows = q_pos[start:start + block]
        scores = (q[:, start:start + block].float() @ keys.transpose(1, 2)) * scale  # [heads, b, n]
        scores.masked_fill_(key_pos[None, None, :] > rows[None, :, None], float("-inf"))
        total += torch.softmax(scores, dim=-1).sum(dim=(0, 1))
    return total / (q.shape[0] * q.shape[1])
