"""The batched decode step: each row is the request's own step, whatever its companions."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from engine.model.decode import decode_batch, decode_step
from engine.planners import Mode
from tests.engine.helpers import QUESTION, chunk_inputs

QUESTIONS = [
    QUESTION,
    "Where does the Danube flow?",
    "What is green tea?",
    "How warm is a hive?",
    "Who was Babbage?",
    "Which sea does the river reach?",
]


@pytest.fixture(scope="module")
def prefilled(tiny_engine):
    """Six prefilled requests of different lengths and modes, with their first token."""
    chunks = chunk_inputs(tiny_engine)
    results = []
    for i, question in enumerate(QUESTIONS):
        mode = ("full", "naive", "cacheblend")[i % 3]
        result = tiny_engine.prefill(
            chunks[i % 2 :], question, mode=Mode.named(mode), max_new_tokens=8
        )
        results.append((result.cache, int(result.logits.argmax())))
    return results


def clone(cache):
    copy = type(cache).__new__(type(cache))
    copy.data, copy.length = cache.data.clone(), cache.length
    return copy


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6])
def test_batched_rows_are_bitwise_the_invariant_lone_step(tiny_engine, prefilled, size):
    chosen = prefilled[:size]
    caches = [clone(cache) for cache, _ in chosen]
    batched = decode_batch(tiny_engine.stack, caches, [token for _, token in chosen])
    for i, (cache, token) in enumerate(chosen):
        alone = clone(cache)
        lone_logits = decode_batch(tiny_engine.stack, [alone], [token], invariant=True)[0]
        assert torch.equal(batched[i], lone_logits)
        assert torch.equal(
            caches[i].data[:, :, :, : cache.length + 1], alone.data[:, :, :, : cache.length + 1]
        )
        assert caches[i].length == cache.length + 1


def test_batched_step_matches_the_one_row_step_to_rounding(tiny_engine, prefilled):
    caches = [clone(cache) for cache, _ in prefilled]
    batched = decode_batch(tiny_engine.stack, caches, [token for _, token in prefilled])
    for row, (cache, token) in zip(batched, prefilled):
        alone = decode_step(tiny_engine.stack, clone(cache), token)
        torch.testing.assert_close(row, alone, rtol=1e-5, atol=1e-4)
        assert int(row.argmax()) == int(alone.argmax())


def test_the_row_multiple_is_measured_per_batch_bound_and_pads_to_agreeing_rows(tiny_engine):
    from engine.model.decode import ROW_MULTIPLES, _rows_agree, row_multiple

    stack = tiny_engine.stack
    multiple = row_multiple(stack, 6)
    assert multiple in ROW_MULTIPLES and row_multiple(stack, 6) == multiple  # cached
    x = torch.randn(-(-6 // multiple) * multiple, stack.lm_head.weight.shape[1])
    assert _rows_agree(stack.lm_head, x, multiple)  # the module itself: the kernel the model runs
    nan_rows = torch.tensor([[1.0, 2, 3, 4], [float("nan")] * 4])
    assert not _rows_agree(torch.nn.Linear(4, 8), nan_rows, 1)  # NaN never agrees


def test_rows_of_a_remainder_block_are_checked_too():
    """A kernel that rounds the last row of an odd row count differently (as bfloat16 did on an
    AVX-512 EPYC) agrees on row 0 at every count, so only checking every row exposes it."""
    from engine.model.decode import _rows_agree

    def remainder_kernel(x, weight):
        out = torch.stack(
            [row @ weight.T for row in x]
        )  # row by row: no count-dependent rounding of its own
        if x.shape[0] > 1 and x.shape[0] % 2:
            out[-1] += 1e-3
        return out

    weight, x = torch.randn(5, 4), torch.randn(8, 4)
    linear = partial(remainder_kernel, weight=weight)
    assert not _rows_agree(linear, x, 1)  # 3 rows: the third differs from its lone step
    assert _rows_agree(linear, x, 2)  # even counts only: every row agrees
