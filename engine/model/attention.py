"""Attention of a set of query rows over the cache with an exact causal mask by position.

A query at absolute position p sees exactly the keys at positions <= p, wherever the query
sits in the prompt: a recomputed token in the middle of the context never sees later chunks.
(Public CacheBlend code uses a bottom-right mask that lets interior tokens see later keys;
see LMCache issue 1152.)

The active rows of a request change only at a planner's selecting layers, so the way they
attend (`QueryLayout`: blocks and their masks) is built once per active set and reused by
every layer until the next selection.

On the CPU a block of scattered rows splits its keys in two: the keys before the block's
first row are visible to every row and run without a mask (the masked kernel is ~20% slower
per key); only the keys from the first row on are masked. The two partial results are merged
by their log-sum-exp, which the CPU flash kernel returns. A bfloat16 prefill tail on a CPU with
AVX512-BF16 and no AMX runs the C kernel of `prefill_attention.py` instead (the flash kernel is
no faster in bfloat16 than in float32 there).

On a GPU a masked block folds its grouped-query heads into rows (no `enable_gqa`), so that
the memory-efficient kernel takes it, and `prepare_device` turns cuDNN's attention off: it
builds a plan for every new key length, and every block of every blend has its own
(docs/benchmarks/gpu.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.model import prefill_attention

# Queries per block when the query rows are scattered. Each block attends to the keys up to
# its last query's position, so cost follows the causal triangle while a block stays large
# enough for the kernel to be efficient; 128 was the fastest size for a blend's scattered rows
# (docs/benchmarks/kernels.md, "Attention blocks").
QUERY_BLOCK = 128
# Positions per tile of a prefill's tail on the CPU (`_tiled_tail`): each tile is two kernel
# calls, so larger tiles make fewer calls; its rows see the tile's own keys masked.
TAIL_TILE = 128
# Split a block's keys only when the unmasked head is at least this long (below it the
# second kernel call and the merge cost more than the mask does).
MIN_UNMASKED_HEAD = 128
# The CPU flash kernel that also returns the log-sum-exp (a private ATen op: without it,
# blocks are not split and run masked as a whole). Returns (output, log-sum-exp).
_CPU_FLASH: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None
)


class QueryLayout:
    """How query rows at positions q_pos attend to keys 0..num_keys-1; built once, reused.

    q_pos: [m] strictly increasing positions, all < num_keys. Four shapes:
    - on the CPU, the rows are a tail [s, num_keys) of more than one row (full prefill, a
      prefix's tail, a chunk at ingest, a repair): tiles aligned to position 0 (`_tiled_tail`),
      so that a row's bits do not depend on s;
    - elsewhere, a tail with s <= num_keys / 2: pad the missing head rows and run the plain
      causal kernel (cheaper than masking; the padded rows are discarded);
    - a single row at the last position: no mask at all (decode);
    - otherwise blocks of QUERY_BLOCK rows (`_Block`), each attending to keys [0, end).
    """

    def __init__(self, q_pos: torch.Tensor, num_keys: int, dtype: torch.dtype):
        self.num_rows = q_pos.numel()
        self.num_keys = num_keys
        self.positions = q_pos
        first, last = int(q_pos[0]), int(q_pos[-1])
        is_tail = last == num_keys - 1 and last - first == self.num_rows - 1
        # a prefill's tail on the CPU: position-aligned tiles, each row's bits its own
        # (`_tiled_tail`); a lone last row is a decode step and runs alone
        tileable = is_tail and self.num_rows > 1 and q_pos.device.type == "cpu"
        self.tiled = first if tileable and _CPU_FLASH is not None else None
        self.pad = first if is_tail and first <= num_keys // 2 and self.tiled is None else None
        self.blocks: list[_Block] = []
        if self.pad is None and self.tiled is None:
            for start in range(0, self.num_rows, QUERY_BLOCK):
                self.blocks.append(_Block(start, q_pos[start : start + QUERY_BLOCK], dtype))


class _Block:
    """Query rows [start, stop) of the layout, at positions `rows` (ascending), attending to
    keys [0, end), end = last row + 1.

    `split` > 0 (CPU only): keys [0, split) are visible to every row (split is the first
    row's position) and run unmasked; `mask` then covers keys [split, end) only. With
    split = 0, `mask` covers [0, end). The mask is additive [len(rows), end - split]: 0 where
    key position <= query position, -inf above; None for a single row.
    """

    def __init__(self, start: int, rows: torch.Tensor, dtype: torch.dtype):
        self.start, self.stop, self.end = start, start + rows.numel(), int(rows[-1]) + 1
        first = int(rows[0])
        splittable = rows.numel() > 1 and rows.device.type == "cpu" and _CPU_FLASH is not None
        self.split = first if splittable and first >= MIN_UNMASKED_HEAD else 0
        self.mask = _block_mask(rows, self.split, dtype)
        self._tiled: dict[int, torch.Tensor] = {}

    def mask_for(self, group: int) -> torch.Tensor:
        """The mask repeated for `group` query heads per key head: [group * rows, end - split]."""
        if group not in self._tiled:
            assert self.mask is not None  # only blocks of > 1 row tile (split or folded)
            self._tiled[group] = self.mask.repeat(group, 1)
        return self._tiled[group]


def _block_mask(rows: torch.Tensor, first_key: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask [len(rows), rows[-1] + 1 - first_key] over keys first_key..rows[-1]."""
    if rows.numel() == 1:  # one query sees every key up to itself
        return None
    end = int(rows[-1]) + 1
    hidden = torch.arange(first_key, end, device=rows.device)[None, :] > rows[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=rows.device).masked_fill_(
        hidden, float("-inf")
    )


def prepare_device(device: torch.device) -> None:
    """Process-wide SDPA set-up for an engine on `device`: on CUDA, no cuDNN attention (see the
    module docstring); flash, memory-efficient and math stay. Nothing elsewhere."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: QueryLayout, scale: float
) -> torch.Tensor:
    """Attention output of the layout's query rows. Returns [m, heads * head_dim].

    q: [heads, m, head_dim]; k, v: [kv_heads, num_keys, head_dim] (grouped-query heads allowed).
    """
    gqa = q.shape[0] != k.shape[0]
    if layout.tiled is not None and prefill_attention.available(q, k):
        out = prefill_attention.tail_attention(q, k, v, layout.tiled, scale)
    elif layout.tiled is not None:
        out = _tiled_tail(q, k, v, layout.tiled, scale)
    elif layout.pad is not None:
        out = _padded_causal(q, k, v, layout.pad, scale, gqa)
    else:
        out = torch.cat(
            [_block_attention(q, k, v, block, scale, gqa) for block in layout.blocks], dim=1
        )
    return out.transpose(0, 1).reshape(layout.num_rows, -1)


def attend_each(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """Decode attention of a batch: query row i attends to all of its own request's keys.

    q: [heads, m, head_dim] with m >= len(keys) (rows past len(keys) are padding and get a zero
    output); keys[i], values[i]: [kv_heads, n_i, head_dim], the cache of row i's request up to
    and including row i's own position. Returns [m, heads * head_dim]. Each row runs the same
    unmasked single-row kernel as a request decoding alone (`QueryLayout` of one row at the
    last position), so a row's output does not depend on its companions.
    """
    heads, rows, head_dim = q.shape
    out = q.new_zeros(rows, heads, head_dim)
    for i, (k, v) in enumerate(zip(keys, values)):
        out[i] = _one_row_attention(q[:, i : i + 1], k, v, scale)[:, 0]
    return out.reshape(rows, heads * head_dim)


def _one_row_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query row over every key, no mask: q [heads, 1, head_dim] -> [heads, 1, head_dim].

    Grouped-query heads are folded into rows ([kv_heads, group, head_dim]; query head h uses
    key head h // group), so each key head's K and V are read once for its whole group instead
    of once per query head: decode attention is bound by reading K and V
    (docs/benchmarks/kernels.md, "Attention blocks").
    """
    heads, kv_heads, head_dim = q.shape[0], k.shape[0], q.shape[2]
    folded = q.reshape(kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(folded[None], k[None], v[None], scale=scale)[0]
    return out.reshape(heads, 1, head_dim)


def _block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: _Block, scale: float, gqa: bool
) -> torch.Tensor:
    """One block's output [heads, rows, head_dim]."""
    if block.split:
        return _split_block_attention(q, k, v, block, scale)
    # one row that sees every key: decode
    if block.stop - block.start == 1 and block.end == k.shape[1]:
        return _one_row_attention(q[:, block.start : block.stop], k, v, scale)
    if gqa and block.mask is not None and q.device.type != "cpu":
        return _folded_block_attention(q, k, v, block, scale)
    return F.scaled_dot_product_attention(
        q[None, :, block.start : block.stop],
        k[None, :, : block.end],
        v[None, :, : block.end],
        attn_mask=block.mask,
        scale=scale,
        enable_gqa=gqa,
    )[0]


def _folded_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: _Block, scale: float
) -> torch.Tensor:
    """A masked block with grouped-query heads folded into its rows ([kv_heads, group * rows,
    head_dim], the mask tiled to match), so that no kernel needs `enable_gqa` or repeated K/V."""
    folded, group = _fold_heads(q, k, block)
    out = F.scaled_dot_product_attention(
        folded,
        k[None, :, : block.end],
        v[None, :, : block.end],
        attn_mask=block.mask_for(group),
        scale=scale,
    )[0]
    return out.reshape(q.shape[0], block.stop - block.start, q.shape[2])


def _fold_heads(q: torch.Tensor, k: torch.Tensor, block: _Block) -> tuple[torch.Tensor, int]:
    """The block's query rows with grouped-query heads folded into rows: ([1, kv_heads, group *
    rows, head_dim], group); query head h uses key head h // group, row g * rows + r."""
    heads, kv_heads, head_dim = q.shape[0], k.shape[0], q.shape[2]
    group, rows = heads // kv_heads, block.stop - block.start
    return q[:, block.start : block.stop].reshape(kv_heads, group * rows, head_dim)[None], group


def _split_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: _Block, scale: float
) -> torch.Tensor:
    """Keys [0, split) unmasked plus keys [split, end) masked, merged by log-sum-exp.

    Grouped-query heads are folded into the rows ([kv_heads, group * rows, head_dim]; query
    head h uses key head h // group) so neither call needs K/V repeated. Every row sees key
    `split` (its own position or an earlier one), so no row of the tail is fully masked.
    """
    assert _CPU_FLASH is not None  # blocks split only where the kernel exists
    folded, group = _fold_heads(q, k, block)
    head_out, head_lse = _CPU_FLASH(
        folded, k[None, :, : block.split], v[None, :, : block.split], scale=scale
    )
    tail_out, tail_lse = _CPU_FLASH(
        folded,
        k[None, :, block.split : block.end],
        v[None, :, block.split : block.end],
        attn_mask=block.mask_for(group),
        scale=scale,
    )
    top = torch.maximum(head_lse, tail_lse)
    head_w, tail_w = (head_lse - top).exp_(), (tail_lse - top).exp_()
    merged = (head_out.float() * head_w[..., None] + tail_out.float() * tail_w[..., None]) / (
        head_w + tail_w
    )[..., None]
    return merged.to(q.dtype).reshape(q.shape[0], block.stop - block.start, q.shape[2])


def _padded_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: int, scale: float, gqa: bool
) -> torch.Tensor:
    if pad:
        q = torch.cat([q.new_zeros(q.shape[0], pad, q.shape[2]), q], dim=1)
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa
    )[0]
    return out[:, pad:]


def attention_mass(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float, block: int = 128
) -> torch.Tensor:
    """Attention probability on every key, averaged over heads and query rows: [num_keys].

    q: [heads, m, head_dim]; k: [kv_heads, num_keys, head_dim]; q_pos: [m] ascending.
    Scores are formed in blocks of query rows so memory stays [heads, block, num_keys].
    """
    group = q.shape[0] // k.shape[0]
    keys = k.float().repeat_interleave(group, 0)  # [heads, n, head_dim]
    key_pos = torch.arange(k.shape[1], device=k.device)
    total = torch.zeros(k.shape[1], dtype=torch.float32, device=k.device)
    for start in range(0, q.shape[1], block):
        rows = q_pos[start : start + block]
        # [heads, b, n]
        scores = (q[:, start : start + block].float() @ keys.transpose(1, 2)) * scale
        scores.masked_fill_(key_pos[None, None, :] > rows[None, :, None], float("-inf"))
        total += torch.softmax(scores, dim=-1).sum(dim=(0, 1))
    return total / (q.shape[0] * q.shape[1])


def _tiled_tail(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float
) -> torch.Tensor:
    """Rows [first, num_keys) by tiles of TAIL_TILE positions aligned to position 0:
    [heads, m, head_dim].

    A row's output depends only on its position, its query and the keys up to it, not on which
    other rows are computed with it: every tile [t, t + TAIL_TILE) runs as one call of a whole
    tile of query rows (zero rows where the call has none, discarded) over keys [0, t) unmasked
    and keys [t, t + TAIL_TILE) masked (zero past the prompt's end), merged by log-sum-exp. So
    the kernel sees the same shapes for a row's tile whatever rows the call computes, and full
    prefill, a prefix's tail, a chunk at ingest and a repair give a row the same bits. (The
    kernel's bits depend on the number of query rows on some CPUs: AMD EPYC, docs/benchmarks/
    bfloat16.md; tests/engine/test_tiled_tail.py fails where a call's rows change them.)
    """
    assert _CPU_FLASH is not None  # tiled only where the kernel exists
    heads, m, head_dim = q.shape
    kv_heads, num_keys = k.shape[0], k.shape[1]
    group, tile = heads // kv_heads, TAIL_TILE
    out = q.new_empty(heads, m, head_dim)
    mask = _tile_mask(tile, group, q.dtype)
    for start in range(first // tile * tile, num_keys, tile):
        lo, hi = max(start, first), min(start + tile, num_keys)  # rows [lo, hi) of the tile
        rows = q.new_zeros(heads, tile, head_dim)
        rows[:, lo - start : hi - start] = q[:, lo - first : hi - first]
        # folded: [1, kv_heads, group * tile, head_dim], query head h on key head h // group
        folded = rows.reshape(kv_heads, group * tile, head_dim)[None]
        k_tile, v_tile = (_padded_keys(x, start, hi, tile) for x in (k, v))
        result, lse = _CPU_FLASH(folded, k_tile, v_tile, attn_mask=mask, scale=scale)
        if start:
            head, head_lse = _CPU_FLASH(folded, k[None, :, :start], v[None, :, :start], scale=scale)
            result = _merge(head, head_lse, result, lse).to(q.dtype)
        tile_out = result.reshape(heads, tile, head_dim)
        out[:, lo - first : hi - first] = tile_out[:, lo - start : hi - start]
    return out


def _padded_keys(x: torch.Tensor, start: int, stop: int, tile: int) -> torch.Tensor:
    """Keys (or values) [start, stop) padded with zeros to `tile` rows: [1, kv_heads, tile, d]."""
    padded = x.new_zeros(x.shape[0], tile, x.shape[2])
    padded[:, : stop - start] = x[:, start:stop]
    return padded[None]


@functools.cache
def _tile_mask(tile: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Causal additive mask of a tile's folded rows over its own keys: [group * tile, tile]
    (the tile's mask once per query head of a key head; shared, read only)."""
    hidden = torch.ones(tile, tile, dtype=torch.bool).triu_(1)
    one = torch.zeros(tile, tile, dtype=dtype).masked_fill_(hidden, float("-inf"))
    return one.repeat(group, 1)


def _merge(
    head_out: torch.Tensor, head_lse: torch.Tensor, tail_out: torch.Tensor, tail_lse: torch.Tensor
) -> torch.Tensor:
    """Two partial attentions over disjoint keys as one, in float32, by their log-sum-exp."""
    top = torch.maximum(head_lse, tail_lse)
    head_w, tail_w = (head_lse - top).exp_(), (tail_lse - top).exp_()
    return (head_out.float() * head_w[..., None] + tail_out.float() * tail_w[..., None]) / (
        head_w + tail_w
    )[..., None]
