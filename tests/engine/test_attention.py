"""The position-causal attention against a dense reference."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import (
    QUERY_BLOCK,
    QueryLayout,
    _folded_block_attention,
    attend_each,
    causal_attention,
)


def reference(q, k, v, q_pos, scale):
    """Dense softmax attention with key position <= query position; GQA by repetition."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0)
    v = v.repeat_interleave(group, 0)
    scores = (q @ k.transpose(1, 2)) * scale  # [heads, m, n]
    allowed = torch.arange(k.shape[1])[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.transpose(0, 1).reshape(q.shape[1], -1)


@pytest.mark.parametrize(
    "n,m", [(50, 50), (300, 7), (700, 2 * QUERY_BLOCK + 3), (40, 1), (500, 400)]
)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_matches_dense_reference(n, m, heads, kv_heads):
    torch.manual_seed(n + m)
    q = torch.randn(heads, m, 16)
    k, v = torch.randn(kv_heads, n, 16), torch.randn(kv_heads, n, 16)
    q_pos = torch.arange(n - m, n) if m >= n // 2 else torch.randperm(n)[:m].sort().values
    got = causal_attention(q, k, v, QueryLayout(q_pos, n, q.dtype), 0.25)
    torch.testing.assert_close(got, reference(q, k, v, q_pos, 0.25), rtol=1e-4, atol=1e-5)


def test_a_query_ignores_keys_after_its_position():
    torch.manual_seed(0)
    q = torch.randn(2, 3, 8)
    k, v = torch.randn(2, 20, 8), torch.randn(2, 20, 8)
    q_pos = torch.tensor([2, 9, 14])
    layout = QueryLayout(q_pos, 20, q.dtype)
    before = causal_attention(q, k, v, layout, 0.3)
    k[:, 15:], v[:, 15:] = 100.0, 100.0  # keys after every query
    k[:, 10:15], v[:, 10:15] = -5.0, 7.0  # keys visible only to the last query
    after = causal_attention(q, k, v, layout, 0.3)
    torch.testing.assert_close(after[:2], before[:2])
    assert not torch.allclose(after[2], before[2])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_blocks_far_from_the_start_split_their_keys_and_still_match(heads, kv_heads):
    """Late blocks run the keys before their first row unmasked; the merge must be exact."""
    torch.manual_seed(7)
    n = 1200
    q_pos = torch.cat(
        [torch.tensor([3, 40]), torch.randperm(n - 600)[: 2 * QUERY_BLOCK].sort().values + 600]
    )
    q = torch.randn(heads, q_pos.numel(), 16)
    k, v = torch.randn(kv_heads, n, 16), torch.randn(kv_heads, n, 16)
    layout = QueryLayout(q_pos, n, q.dtype)
    assert [b.split > 0 for b in layout.blocks] == [False, True, True]
    got = causal_attention(q, k, v, layout, 0.25)
    torch.testing.assert_close(got, reference(q, k, v, q_pos, 0.25), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 2)])
def test_masked_blocks_with_heads_folded_into_rows_match_the_reference(
    heads, kv_heads, monkeypatch
):
    """The GPU's path for masked blocks (`_folded_block_attention`), run here on the CPU, whose
    blocks are built unsplit as a GPU's are."""
    monkeypatch.setattr("engine.model.attention._CPU_FLASH", None)
    torch.manual_seed(11)
    n = 400
    q_pos = torch.cat(
        [torch.tensor([0, 5]), torch.randperm(n - 10)[: QUERY_BLOCK + 9].sort().values + 10]
    )
    q = torch.randn(heads, q_pos.numel(), 16)
    k, v = torch.randn(kv_heads, n, 16), torch.randn(kv_heads, n, 16)
    layout = QueryLayout(q_pos, n, q.dtype)
    assert [b.split for b in layout.blocks] == [0, 0] and all(
        b.mask is not None for b in layout.blocks
    )
    out = torch.cat([_folded_block_attention(q, k, v, b, 0.25) for b in layout.blocks], dim=1)
    got = out.transpose(0, 1).reshape(q_pos.numel(), -1)
    torch.testing.assert_close(got, reference(q, k, v, q_pos, 0.25), rtol=1e-4, atol=1e-5)


def test_split_blocks_keep_low_precision_dtypes():
    torch.manual_seed(3)
    n, q_pos = 900, torch.arange(500, 900, 3)
    q = torch.randn(6, q_pos.numel(), 16, dtype=torch.bfloat16)
    k, v = torch.randn(2, n, 16, dtype=torch.bfloat16), torch.randn(2, n, 16, dtype=torch.bfloat16)
    got = causal_attention(q, k, v, QueryLayout(q_pos, n, q.dtype), 0.25)
    assert got.dtype == torch.bfloat16
    expected = reference(q.float(), k.float(), v.float(), q_pos, 0.25)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_a_decode_row_with_grouped_heads_matches_the_reference(heads, kv_heads):
    """The last row alone folds its query heads per key head (`_one_row_attention`); batched
    rows each over their own cache (`attend_each`) must give the same output as alone."""
    torch.manual_seed(11)
    lengths = (70, 33)
    q = torch.randn(heads, len(lengths) + 1, 16)  # one padding row
    keys = [torch.randn(kv_heads, n, 16) for n in lengths]
    values = [torch.randn(kv_heads, n, 16) for n in lengths]
    batched = attend_each(q, keys, values, 0.25)
    for i, n in enumerate(lengths):
        alone = causal_attention(
            q[:, i : i + 1],
            keys[i],
            values[i],
            QueryLayout(torch.tensor([n - 1]), n, q.dtype),
            0.25,
        )
        torch.testing.assert_close(
            alone,
            reference(q[:, i : i + 1], keys[i], values[i], torch.tensor([n - 1]), 0.25),
            rtol=1e-4,
            atol=1e-5,
        )
        assert torch.equal(batched[i], alone[0])
    assert not batched[len(lengths)].any()
