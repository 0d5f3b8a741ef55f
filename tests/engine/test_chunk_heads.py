"""The opening rows of chunks cached in another context are recomputed first by the blending
modes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig, Fidelity
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import QUESTION, chunk_inputs, plan_request


def test_heads_cover_chunks_cached_elsewhere_only(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    chunks[2] = ChunkInput(chunks[2].chunk_id, chunks[2].token_ids)  # not cached: computed anyway
    request = plan_request(tiny_engine, chunks)
    heads = request.chunk_heads(3)
    spans = request.layout.chunk_spans
    expected = torch.zeros_like(heads)
    for i in (1, 3):  # chunk 0's base variant is exact first in the prompt
        expected[spans[i][0] : spans[i][0] + 3] = True
    assert torch.equal(heads, expected)
    assert not bool(request.chunk_heads(0).any())
    longest = max(end - start for start, end in spans)
    assert int(request.chunk_heads(longest + 5).sum()) == sum(
        spans[i][1] - spans[i][0] for i in (1, 3)
    )


def test_a_variant_computed_after_the_same_chunks_has_no_head(tiny_engine):
    chunks = chunk_inputs(tiny_engine)[:2]
    exact_second = dataclasses.replace(chunks[1].kv, context=(chunks[0].chunk_id,))
    request = plan_request(
        tiny_engine, [chunks[0], ChunkInput(chunks[1].chunk_id, chunks[1].token_ids, exact_second)]
    )
    assert not bool(request.chunk_heads(4).any())
    swapped = plan_request(
        tiny_engine, [ChunkInput(chunks[1].chunk_id, chunks[1].token_ids, exact_second), chunks[0]]
    )
    start = swapped.layout.chunk_spans[0][0]
    assert swapped.chunk_heads(4)[start : start + 4].all()  # first here, but computed after chunk 0


@pytest.mark.parametrize("mode", ["cacheblend", "cachecraft"])
def test_blending_modes_recompute_every_head_row_through_every_layer(tiny_engine, mode):
    chunks = chunk_inputs(tiny_engine)
    layers = tiny_engine.loaded.spec.num_layers
    config = dataclasses.replace(tiny_engine.config, blend_head_tokens=2, focus_layer=None)
    result = tiny_engine.prefill(
        chunks,
        QUESTION,
        mode=Mode.named(mode),
        ratio=0.5,
        fidelity=Fidelity.named("fast"),
        config=config,
    )
    heads = plan_request(tiny_engine, chunks, config).chunk_heads(2)
    assert bool((result.layers_computed[heads] == layers).all())
    none = dataclasses.replace(config, blend_head_tokens=0)
    plain = tiny_engine.prefill(
        chunks,
        QUESTION,
        mode=Mode.named(mode),
        ratio=0.5,
        fidelity=Fidelity.named("fast"),
        config=none,
    )
    assert int(plain.layers_computed.sum()) == int(result.layers_computed.sum())  # the same budget


def test_ratio_zero_keeps_no_head_rows(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    config = EngineConfig(
        data_dir=tiny_engine.config.data_dir, blend_head_tokens=4, fidelity="fast"
    )
    result = tiny_engine.prefill(
        chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=0.0, config=config
    )
    heads = plan_request(tiny_engine, chunks, config).chunk_heads(4)
    assert bool((result.layers_computed[heads] < tiny_engine.loaded.spec.num_layers).all())
