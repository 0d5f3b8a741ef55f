"""A prefill's row-wise products in calls of exactly `ROW_TILE` rows, so a row's bits are its own.

The CPU's matrix libraries choose their code, and with it the order in which a row's products
are summed, by the product's shape: MKL in float32 and oneDNN on AMX in bfloat16 give a row
other bits in a call of 64 rows than in one of 2,048. In calls of one fixed row count a row
comes out the same whatever rows share the call and wherever it sits among them (both libraries,
docs/benchmarks/bfloat16.md, "Row tiles"). So on the CPU a prefill runs its linear layers and
MLP in calls of `ROW_TILE` rows, the last one padded with zero rows: a reused prefix's tail, a
chunk's KV from ingest and a repair's rows get full prefill's bits. Decode steps are not tiled:
their rows are computed once, and padding a step to a tile would cost most of a tile's compute.

Where a row's bits do not depend on its call's row count at all (a probe at load says so:
engine/serving/row_bits.py), padding only costs: a prefill then runs in calls of up to
`FREE_TILE` rows, the last one as long as what is left (`pad=False`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows per call of a tiled product. Smaller tiles make a short tail (a question after a
# reused prefix, a repair) cheaper; larger ones make fewer calls.
ROW_TILE = 128
# Rows per call where calls need not be alike: large enough for the kernel's peak, small
# enough to bound a call's scratch (an MLP's intermediate rows).
FREE_TILE = 512


def row_tile_for(device: torch.device) -> int | None:
    """The tile a prefill's products run in on `device`: ROW_TILE on the CPU, None (one call
    for all rows) elsewhere."""
    return ROW_TILE if device.type == "cpu" else None


def by_row_tiles(
    rowwise: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile: int | None,
    pad: bool = True,
) -> torch.Tensor:
    """`rowwise(x)` for rows x [m, d], computed in calls of exactly `tile` rows (the last padded
    with zero rows, whose results are dropped; `pad` False: the last has the rows left); `tile`
    None: one call. `rowwise` must compute each row from that row alone (a linear layer, an
    MLP)."""
    rows = x.shape[0]
    if tile is None or rows <= (0 if pad else tile):
        return rowwise(x)
    whole = rows - rows % tile
    outs = [rowwise(x[start : start + tile]) for start in range(0, whole, tile)]
    if whole < rows and not pad:
        outs.append(rowwise(x[whole:]))
    elif whole < rows:
        last = x.new_zeros((tile, *x.shape[1:]))
        last[: rows - whole] = x[whole:]
        outs.append(rowwise(last)[: rows - whole])
    return outs[0] if len(outs) == 1 else torch.cat(outs)
