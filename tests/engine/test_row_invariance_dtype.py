"""Reused and repaired rows are bit for bit full prefill's, in float32 and in bfloat16.

A row's bits must not depend on the rows computed with it: the system prefix computed alone,
a chunk's KV from a prefill of another (longer or shorter) prompt, and a repair's prefill of
the prompt plus the answer so far all compute the same rows as full prefill of the prompt, in
passes of other sizes. Compared with `torch.equal`, never a tolerance. Tiny random-weight
Llama built per dtype (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.variants.harvest import chunk_rows
from engine import EngineConfig
from engine.config import Fidelity
from engine.decoding import read_out
from engine.engine import Engine
from engine.model.decode import SamplingParams
from engine.planners import Mode
from tests.conftest import build_tiny_model
from tests.engine.helpers import QUESTION, chunk_inputs

DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module", params=DTYPES)
def engine(request, smol_tokenizer, tmp_path_factory) -> Engine:
    from engine.model.loader import wrap_model

    model = build_tiny_model(len(smol_tokenizer)).to(getattr(torch, request.param))
    return Engine(
        EngineConfig(
            data_dir=tmp_path_factory.mktemp(f"rows-{request.param}"),
            fidelity="fast",
            encode_dtype="engine",
        ),
        wrap_model(model, smol_tokenizer),
    )


def prompt_rows(result) -> torch.Tensor:
    """Every prompt row of the result's cache: [layers, 2, kv_heads, total, head_dim]."""
    return result.cache.rows(0, result.layout.total_len)


def test_a_reused_exact_prefix_is_full_prefill_bit_for_bit(engine):
    chunks = chunk_inputs(engine)
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    # chunks 1 and 2 as exact variants from a shorter prompt with another question
    other = engine.prefill(chunks[:3], "Which river?", mode=Mode.named("full"))
    reused = (
        [chunks[0]]
        + [
            dataclasses.replace(c, kv=chunk_rows(engine, other, i))
            for i, c in enumerate(chunks[1:3], 1)
        ]
        + chunks[3:]
    )
    prefix = engine.prefill(reused, QUESTION, mode=Mode.named("prefix"))
    assert [c.recomputed for c in prefix.chunks] == [0, 0, 0, prefix.chunks[3].tokens]
    assert torch.equal(prompt_rows(prefix), prompt_rows(full))
    assert torch.equal(prefix.logits, full.logits)


def test_a_chunk_s_kv_from_ingest_is_full_prefill_s_rows(engine):
    """The first chunk's base variant (packed with the others at ingest, after the system
    prefix computed alone) is its rows in full prefill."""
    chunks = chunk_inputs(engine)
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    start, end = full.layout.chunk_spans[0]
    assert torch.equal(chunks[0].kv.kv, full.cache.rows(start, end))


def test_a_repair_s_exact_rows_are_full_prefill_s(engine):
    chunks = chunk_inputs(engine)
    guarded = Engine(
        EngineConfig(
            data_dir=engine.config.data_dir,
            guard_margin=0.0,
            guard_answer_margin=1e9,
            reuse_profile="off",
            batching=False,
        ),
        engine.loaded,
    )
    params = SamplingParams(max_new_tokens=8)
    result = guarded.prefill(
        chunks,
        QUESTION,
        mode=Mode.named("cacheblend"),
        max_new_tokens=params.max_new_tokens,
        fidelity=Fidelity.named("balanced"),
    )
    decoded = read_out(guarded.generate(result, params))[1]
    assert decoded.repaired
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    total = full.layout.total_len
    assert torch.equal(decoded.cache.rows(0, total), prompt_rows(full))
