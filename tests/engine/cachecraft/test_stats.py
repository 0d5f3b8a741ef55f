"""Attention statistics: per-row segment masses and the per-chunk numbers built from them."""

from __future__ import annotations

import pytest
import torch

from engine.cachecraft.stats import chunk_stats, segment_attention_mass
from engine.prompt import PromptLayout


def dense_mass(q, k, q_pos, segments, num_segments, scale):
    group = q.shape[0] // k.shape[0]
    keys = k.repeat_interleave(group, 0)
    scores = (q @ keys.transpose(1, 2)) * scale
    scores = scores.masked_fill(
        torch.arange(k.shape[1])[None, None] > q_pos[None, :, None], float("-inf")
    )
    probs = torch.softmax(scores, -1).mean(0)
    return torch.stack([probs[:, segments == s].sum(1) for s in range(num_segments)], dim=1)


@pytest.mark.parametrize("rows", [5, 300])
def test_segment_mass_matches_dense_reference_and_sums_to_one(rows):
    torch.manual_seed(rows)
    n = 320
    q, k = torch.randn(4, rows, 8), torch.randn(2, n, 8)
    q_pos = torch.randperm(n)[:rows].sort().values
    segments = torch.randint(0, 3, (n,))
    got = segment_attention_mass(q, k, q_pos, segments, 3, 0.35)
    torch.testing.assert_close(
        got, dense_mass(q, k, q_pos, segments, 3, 0.35), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(got.sum(1), torch.ones(rows))


def test_chunk_stats_from_masses():
    layout = PromptLayout(prefix_ids=(1, 2), chunk_ids=((3, 4), (5, 6, 7)), question_ids=(8,))
    # segments: 0 prefix, 1 chunk a, 2 chunk b, 3 question; rows of chunk b attend as below
    mass = torch.zeros(layout.total_len, 4)
    mass[2:4] = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.4, 0.6, 0.0, 0.0]])
    mass[4:7] = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.1, 0.1, 0.8, 0.0], [0.3, 0.2, 0.5, 0.0]])
    first, second = chunk_stats(mass, layout, ["a", "b"])
    assert first.context == () and first.inter == {} and first.a == 0.0 and first.cci == 0.5
    assert second.context == ("a",)
    assert second.inter["a"] == pytest.approx(0.6)
    assert second.intra == pytest.approx(1.8)
    assert second.token_scores == pytest.approx([0.3, 0.1, 0.2])
    assert second.a == pytest.approx(0.6 / (3 * 2)) and second.b == pytest.approx(1.8 / 9)
