"""Attention of a set of query rows over the cache with an exact causal mask by position.

A query at absolute position p sees exactly the keys at positions <= p, wherever the query
sits in the prompt: a recomputed token in the middle of the context never sees later chunks.
(Public CacheBlend code uses a bottom-right mask that lets interior tokens see later keys;
see LMCache issue 1152.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Queries per block when the query rows are not the whole prompt. Each block attends to the
# keys up to its last query's position, so cost falls with the causal triangle while a block
# stays large enough for the matmuls to be efficient (measured: 4-8 blocks for ~600 rows).
QUERY_BLOCK = 160


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention output for query rows at positions q_pos over keys at positions 0..len-1.

    q: [heads, m, head_dim]; k, v: [kv_heads, n, head_dim] (grouped-query heads allowed);
    q_pos: [m], strictly increasing, every value < n. Returns [m, heads * head_dim].
    """
    m, n = q.shape[1], k.shape[1]
    gqa = q.shape[0] != k.shape[0]
    if m == n:  # every row is a query: the plain causal triangle
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                             scale=scale, enable_gqa=gqa)[0]
    else:
        out = torch.cat([_block_attention(q[:, s:s + QUERY_BLOCK], k, v, q_pos[s:s + QUERY_BLOCK], scale, gqa)
                         for s in range(0, m, QUERY_BLOCK)], dim=1)
    return out.transpose(0, 1).reshape(m, -1)


def _block_attention(q, k, v, q_pos, scale, gqa):
    end = int(q_pos[-1]) + 1
    if q.shape[1] == 1:  # one query sees every key up to itself: no mask needed
        mask = None
    else:
        key_pos = torch.arange(end, device=q.device)
        mask = key_pos[None, :] <= q_pos[:, None]  # [m, end]: key position <= query position
    return F.scaled_dot_product_attention(q[None], k[None, :, :end], v[None, :, :end],
                                          attn_mask=mask, scale=scale, enable_gqa=gqa)[0]
