"""A prefill tail's attention gives a row full prefill's bits whatever rows the call computes.

On some CPUs (AMD EPYC, Zen 4) the flash kernel's bits depend on how many query rows a call
has (docs/benchmarks/bfloat16.md); the tiles pad every call to whole tiles so that they do not.
Compared with `torch.equal` in the two known models' head shapes, through the engine's own
`causal_attention` (a tail of more than one row takes the tiles on the CPU; a bfloat16 tail on
a CPU with AVX512-BF16 and no AMX takes engine/cpu/prefill_attention.c instead, held to the
same here).
"""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import TAIL_TILE, QueryLayout, causal_attention

# (query heads, key heads): Qwen2.5-Coder-0.5B's and SmolLM2-135M's
HEADS = [(14, 2), (9, 3)]
# tails ending inside a tile and at a tile's end, of lengths that share no tile boundary
ENDS = [TAIL_TILE * 2 + 4, TAIL_TILE * 2 + 44, TAIL_TILE * 3]
ROWS = list(range(2, 40))


def tail_rows(q, k, v, end: int, rows: int) -> torch.Tensor:
    positions = torch.arange(end - rows, end)
    layout = QueryLayout(positions, end, q.dtype)
    assert layout.tiled is not None  # the CPU's tail path, not a dense or blocked layout
    return causal_attention(q[:, end - rows : end], k[:, :end], v[:, :end], layout, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_a_tail_s_rows_are_full_prefill_s_bit_for_bit(heads, kv_heads, dtype):
    generator = torch.Generator().manual_seed(0)
    n = max(ENDS)
    q, k, v = (
        torch.randn(h, n, 64, generator=generator).to(dtype) for h in (heads, kv_heads, kv_heads)
    )
    for end in ENDS:
        full = tail_rows(q, k, v, end, end)
        differ = [
            rows
            for rows in ROWS
            if not torch.equal(tail_rows(q, k, v, end, rows), full[end - rows :])
        ]
        assert differ == [], f"a tail ending at {end} differs from full prefill for {differ} rows"
