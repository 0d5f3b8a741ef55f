"""The PyTorch twins of `engine/model/ops.py` against straightforward reference code.

The twins are the reference the CUDA kernels are held to (tests/engine/test_kernels.py), so
they are checked here against loops written for clarity: float64 per-pair rotations, sums
over every element, a sort by (score, row), row copies one at a time.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.model import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One rounding to the dtype, relative to the largest magnitude.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def cache_view(dtype, layers=3, kv_heads=3, capacity=40, head_dim=16, start=5, end=29, seed=0):
    """(backing [layers, 2, kv_heads, capacity, head_dim], K of layer 1 rows start..end as a
    view)."""
    torch.manual_seed(seed)
    data = torch.randn(layers, 2, kv_heads, capacity, head_dim).to(dtype)
    return data, data[1, 0, :, start:end]


# -- references -----------------------------------------------------------------------------


def reference_rope_shift(k: torch.Tensor, delta, freqs: torch.Tensor) -> torch.Tensor:
    """Each (i, i + half) pair of each row rotated by delta_row * freqs[i], in float64."""
    out = k.double().clone()
    half = k.shape[-1] // 2
    rows = k.shape[-2]
    for t in range(rows):
        shift = int(delta) if isinstance(delta, int) else int(delta[t])
        for i in range(half):
            angle = shift * float(freqs[i])
            c, s = math.cos(angle), math.sin(angle)
            x1, x2 = k[..., t, i].double(), k[..., t, i + half].double()
            out[..., t, i] = x1 * c - x2 * s
            out[..., t, i + half] = x2 * c + x1 * s
    return out


def fresh_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE of unrotated x [heads, tokens, head_dim] at `positions`, in float64."""
    angles = positions.double()[:, None] * freqs.double()[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1).double()
    return x.double() * cos + rotated * sin


def reference_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    heads, tokens, head_dim = fresh.shape
    out = torch.zeros(tokens, dtype=torch.float64)
    for t in range(tokens):
        for h in range(heads):
            out[t] += ((fresh[h, t].double() - cached[h, t].double()) ** 2).sum()
    return out


def reference_top_rows(scores: torch.Tensor, count: int, eligible) -> list[int]:
    """Best first: higher score (NaN highest), then the earlier row; the first `count`,
    ascending."""
    rows = [t for t in range(scores.numel()) if eligible is None or bool(eligible[t])]
    key = lambda t: (math.inf if math.isnan(float(scores[t])) else float(scores[t]), -t)  # noqa: E731
    best = sorted(rows, key=key, reverse=True)[: max(0, count)]
    return sorted(best)


def assert_close_to(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(expected.abs().max().clamp_min(1.0))
    error = float((got.double() - expected.double()).abs().max())
    assert error <= TOLERANCE[dtype] * scale, f"max error {error:.3g} (scale {scale:.3g})"


# -- rope shift -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delta", [1, 37, -5, 4000])
def test_rope_shift_matches_reference_on_a_cache_view(dtype, delta):
    data, k = cache_view(dtype)
    before = data.clone()
    expected = reference_rope_shift(k.clone(), delta, inv_freq(16))
    assert ops.rope_shift_twin_(k, delta, inv_freq(16)) is k
    assert_close_to(k, expected, dtype)
    changed = torch.zeros_like(data, dtype=torch.bool)
    changed[1, 0, :, 5:29] = True
    assert torch.equal(data[~changed], before[~changed]), "rows outside the view were written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 8), (2, 3, 11, 32), (4, 1, 64)])
def test_rope_shift_per_row_deltas(dtype, shape):
    torch.manual_seed(1)
    k = torch.randn(shape).to(dtype)
    delta = torch.randint(-300, 300, (shape[-2],))
    freqs = inv_freq(shape[-1], theta=1e5)
    expected = reference_rope_shift(k.clone(), delta, freqs)
    assert_close_to(ops.rope_shift_twin_(k, delta, freqs), expected, dtype)


def test_rope_shift_of_zero_is_a_no_op():
    k = torch.randn(3, 5, 8)
    same = k.clone()
    assert ops.rope_shift_(k, 0, inv_freq(8)) is k
    assert torch.equal(k, same)


def test_rope_shift_composes_with_fresh_rope():
    """RoPE at p, shifted by delta, is RoPE at p + delta (float32, to rounding)."""
    torch.manual_seed(2)
    x = torch.randn(3, 20, 64)
    freqs = inv_freq(64, theta=1e5)
    base = torch.arange(7, 27)
    for delta in (1, 250, 3000, -7):
        k = fresh_rope(x, base, freqs).float()
        shifted = ops.rope_shift_twin_(k, delta, freqs)
        torch.testing.assert_close(
            shifted.double(), fresh_rope(x, base + delta, freqs), rtol=0, atol=2e-5
        )


def test_rope_shift_dispatcher_equals_twin_on_cpu():
    data, k = cache_view(torch.float32)
    twin = ops.rope_shift_twin_(k.clone(), 9, inv_freq(16))
    torch.testing.assert_close(ops.rope_shift_(k, 9, inv_freq(16)), twin, rtol=0, atol=0)


# -- deviation and top rows -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,tokens,head_dim", [(3, 17, 64), (1, 5, 8), (2, 1, 16)])
def test_kv_deviation_matches_reference(dtype, kv_heads, tokens, head_dim):
    torch.manual_seed(3)
    fresh = (
        torch.randn(tokens, kv_heads, head_dim).to(dtype).transpose(0, 1)
    )  # as project_kv makes it
    _, cached_all = cache_view(
        dtype, kv_heads=kv_heads, capacity=tokens + 9, head_dim=head_dim, start=4, end=4 + tokens
    )
    got = ops.kv_deviation_twin(fresh, cached_all)
    assert got.dtype == torch.float32 and got.shape == (tokens,)
    torch.testing.assert_close(
        got.double(), reference_deviation(fresh, cached_all), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(ops.kv_deviation(fresh, cached_all), got, rtol=0, atol=0)


def random_scores(n: int, seed: int, levels: int | None = 4) -> torch.Tensor:
    """Scores with many ties (few levels), or all distinct (levels None)."""
    torch.manual_seed(seed)
    return torch.randint(0, levels, (n,)).float() if levels else torch.rand(n)


@pytest.mark.parametrize("n", [1, 9, 300])
@pytest.mark.parametrize("count", [0, 1, 5, 150, 1000])
@pytest.mark.parametrize("levels", [None, 3])
@pytest.mark.parametrize("with_mask", [False, True])
def test_top_rows_matches_reference(n, count, levels, with_mask):
    scores = random_scores(n, seed=n + count, levels=levels)
    eligible = (torch.rand(n) > 0.4) if with_mask else None
    got = ops.top_rows_twin(scores, count, eligible)
    assert got.dtype == torch.long
    assert got.tolist() == reference_top_rows(scores, count, eligible)
    assert ops.top_rows(scores, count, eligible).tolist() == got.tolist()


def test_top_rows_keeps_the_earlier_row_on_ties():
    scores = torch.zeros(50)
    scores[10:40] = 1.0
    assert ops.top_rows_twin(scores, 5).tolist() == [10, 11, 12, 13, 14]


def test_top_rows_edge_values():
    scores = torch.tensor([1.0, math.nan, 3.0, math.nan, -0.0, 0.0, -math.inf, -math.inf])
    eligible = torch.tensor([1, 1, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    assert ops.top_rows_twin(scores, 3).tolist() == [1, 2, 3]  # NaN counts as highest
    assert ops.top_rows_twin(scores, 5).tolist() == [0, 1, 2, 3, 4]  # -0 ties with 0: earlier row
    # an eligible -inf row is taken before an ineligible one
    assert ops.top_rows_twin(scores, 7, eligible).tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert ops.top_rows_twin(scores, 3, torch.zeros(8, dtype=torch.bool)).tolist() == []
    assert ops.top_rows_twin(scores, -2).tolist() == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_deviation_top_rows_is_top_rows_of_deviation(dtype):
    torch.manual_seed(4)
    fresh, cached = torch.randn(3, 40, 16).to(dtype), torch.randn(3, 40, 16).to(dtype)
    eligible = torch.rand(40) > 0.3
    expected = ops.top_rows_twin(ops.kv_deviation_twin(fresh, cached), 9, eligible)
    assert torch.equal(ops.deviation_top_rows(fresh, cached, 9, eligible), expected)


# -- gather / scatter -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_rows_matches_a_loop(dtype):
    data, _ = cache_view(dtype)
    x = data[2]  # [2, kv_heads, capacity, head_dim], as the runner gathers a layer
    index = torch.tensor([0, 7, 39, 3, 3])
    got = ops.gather_rows_twin(x, index)
    for j, row in enumerate(index.tolist()):
        assert torch.equal(got[..., j, :], x[..., row, :])
    assert torch.equal(ops.gather_rows(x, index), got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", [None, torch.float32])
def test_scatter_rows_matches_a_loop(dtype, src_dtype):
    data, _ = cache_view(dtype)
    torch.manual_seed(5)
    index = torch.tensor([3, 0, 31, 12])
    src = (
        torch.randn(4, 3, 16).to(src_dtype or dtype).transpose(0, 1)
    )  # [kv_heads, 4, head_dim], strided
    expected = data.clone()
    for j, row in enumerate(index.tolist()):
        expected[1, 1, :, row] = src[:, j].to(dtype)
    dst = data[1, 1]
    assert ops.scatter_rows_twin_(dst, index, src) is dst
    assert torch.equal(data, expected)
    again = expected.clone()
    ops.scatter_rows_(again[1, 1], index, src)
    assert torch.equal(again, expected)


def test_cpu_ops_never_load_the_kernel_library(monkeypatch):
    from engine import kernels

    def refuse():
        raise AssertionError("a CPU tensor asked for the kernel library")

    monkeypatch.setattr(kernels, "get", refuse)
    k = torch.randn(2, 4, 8)
    ops.rope_shift_(k, 3, inv_freq(8))
    ops.top_rows(ops.kv_deviation(k, k.flip(1)), 2)
    ops.scatter_rows_(k, torch.tensor([1]), ops.gather_rows(k, torch.tensor([2])))
