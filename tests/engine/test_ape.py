"""APE's reading of reused chunks in the engine (engine/ape.py): its formula, the prefill's
and every decode step's rows after the chunks, and the requests that may ask for it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from engine.ape import ApeKnobs, ContextReading
from engine.config import Fidelity
from engine.errors import InvalidRequest
from engine.model.decode import decode_batch, twin_batch
from engine.planners import Mode
from tests.engine.helpers import QUESTION, chunk_inputs

HEADS, KV_HEADS, HEAD_DIM, KEYS = 4, 2, 8, 24
START, END = 5, 17  # the contexts: keys [5, 17)


def _tensors(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS, rows, HEAD_DIM, generator=generator) * 2
    k = torch.randn(KV_HEADS, KEYS, HEAD_DIM, generator=generator) * 2
    v = torch.randn(KV_HEADS, KEYS, HEAD_DIM, generator=generator)
    return q, k, v


def _plain(q, k, v, positions, scale):
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    hidden = torch.arange(k.shape[1])[None, :] > positions[:, None]
    mask = torch.zeros(hidden.shape).masked_fill(hidden, -math.inf)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


def _by_segments(q, k, v, positions, knobs, scale):
    """APE's formula as its paper writes it: each segment's own softmax, their masses mixed by
    log-sum-exp (the context's T * lse(l / T) + log S), as the Hugging Face screen computes."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    logits = q @ k.transpose(1, 2) * scale
    logits = logits.masked_fill(torch.arange(k.shape[1])[None, :] > positions[:, None], -math.inf)
    masses, outputs = [], []
    for lo, hi, t, bias in (
        (0, START, 1.0, 0.0),
        (START, END, knobs.temperature, math.log(knobs.scale)),
        (END, k.shape[1], 1.0, 0.0),
    ):
        part = logits[..., lo:hi] / t
        masses.append(torch.logsumexp(part, -1) * t + bias)
        outputs.append(torch.softmax(part, -1).nan_to_num() @ v[:, lo:hi])
    weights = torch.softmax(torch.stack(masses), 0)
    out = sum(w[..., None] * o for w, o in zip(weights, outputs))
    return out.transpose(0, 1).reshape(q.shape[1], -1)


def test_plain_knobs_are_plain_attention():
    q, k, v = _tensors(4)
    positions = torch.tensor([17, 18, 20, 23])
    reading = ContextReading(ApeKnobs(1.0, 1.0), START, END)
    torch.testing.assert_close(
        reading.attention(q, k, v, positions, 0.3), _plain(q, k, v, positions, 0.3)
    )


@pytest.mark.parametrize("knobs", [ApeKnobs(0.9, 0.9), ApeKnobs(0.5, 2.0), ApeKnobs(1.5, 0.3)])
def test_it_computes_apes_segment_formula(knobs):
    q, k, v = _tensors(3, seed=1)
    positions = torch.tensor([17, 21, 23])
    reading = ContextReading(knobs, START, END)
    got = reading.attention(q, k, v, positions, 0.3)
    torch.testing.assert_close(got, _by_segments(q, k, v, positions, knobs, 0.3))
    assert not torch.allclose(got, _plain(q, k, v, positions, 0.3))


def test_a_vanishing_scale_reads_as_if_the_contexts_were_absent():
    q, k, v = _tensors(2, seed=2)
    positions = torch.tensor([20, 23])
    reading = ContextReading(ApeKnobs(0.9, 1e-30), START, END)
    keep = torch.cat([torch.arange(START), torch.arange(END, KEYS)])
    # the same rows over the keys outside the contexts (positions renumbered to the kept keys)
    without = _plain(q, k[:, keep], v[:, keep], positions - (END - START), 0.3)
    torch.testing.assert_close(reading.attention(q, k, v, positions, 0.3), without)


def test_only_rows_after_the_contexts_read_by_ape():
    q, k, v = _tensors(4, seed=3)
    positions = torch.tensor([8, 16, 17, 22])
    plain = _plain(q, k, v, positions, 0.3)
    reading = ContextReading(ApeKnobs(0.7, 0.7), START, END)
    out = reading.read(q, k, v, positions, 0.3, lambda: plain)
    torch.testing.assert_close(out[:2], plain[:2], rtol=0, atol=0)
    torch.testing.assert_close(out[2:], reading.attention(q[:, 2:], k, v, positions[2:], 0.3))
    with pytest.raises(ValueError):
        reading.attention(q, k, v, positions, 0.3)  # a row inside the contexts


def test_plain_attention_runs_only_where_a_row_needs_it():
    q, k, v = _tensors(2, seed=4)
    reading = ContextReading(ApeKnobs(0.7, 0.7), START, END)

    def refused() -> torch.Tensor:
        raise AssertionError("every row reads by APE: no plain attention is needed")

    after = torch.tensor([17, 20])
    torch.testing.assert_close(
        reading.read(q, k, v, after, 0.3, refused), reading.attention(q, k, v, after, 0.3)
    )
    before = torch.tensor([6, 9])
    plain = _plain(q, k, v, before, 0.3)
    assert reading.read(q, k, v, before, 0.3, lambda: plain) is plain


def test_knobs_and_spans_are_checked():
    with pytest.raises(ValueError):
        ApeKnobs(0.0, 1.0)
    with pytest.raises(ValueError):
        ApeKnobs(1.0, -0.5)
    with pytest.raises(ValueError):
        ContextReading(ApeKnobs(1.0, 1.0), 9, 3)


def _config(engine, temperature: float, scale: float):
    return dataclasses.replace(engine.config, ape_temperature=temperature, ape_scale=scale)


@pytest.mark.parametrize("mode", ["naive", "cacheblend"])
def test_plain_knobs_prefill_and_decode_as_without(tiny_engine, mode):
    """T = S = 1 through the engine: the prefill's logits and every decoded step's (on the
    twin, which a reading cache decodes on) are those of the same request without APE."""
    chunks = chunk_inputs(tiny_engine)
    plain = tiny_engine.prefill(chunks, QUESTION, Mode.named(mode), max_new_tokens=4)
    ape = tiny_engine.prefill(
        chunks,
        QUESTION,
        Mode.named(mode),
        max_new_tokens=4,
        config=_config(tiny_engine, 1.0, 1.0),
        ape=True,
    )
    assert ape.cache.reading is not None and plain.cache.reading is None
    assert ape.cache.reading.end == ape.layout.question_span[0]
    torch.testing.assert_close(ape.logits, plain.logits, rtol=1e-4, atol=1e-4)
    stack = tiny_engine.stack
    with torch.inference_mode():
        for token in (5, 9, 11):
            got = twin_batch(stack, [ape.cache], [token])
            want = twin_batch(stack, [plain.cache], [token])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_knobs_change_the_question_and_the_answer(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    plain = tiny_engine.prefill(chunks, QUESTION, Mode.named("naive"), max_new_tokens=4)
    ape = tiny_engine.prefill(
        chunks,
        QUESTION,
        Mode.named("naive"),
        max_new_tokens=4,
        config=_config(tiny_engine, 0.5, 0.5),
        ape=True,
    )
    assert not torch.allclose(ape.logits, plain.logits, rtol=1e-3, atol=1e-3)
    assert bool(torch.isfinite(ape.logits).all())
    # the chunks' and the prefix's cached rows are the same: APE reads them, it does not change them
    end = ape.layout.question_span[0]
    torch.testing.assert_close(ape.cache.rows(0, end), plain.cache.rows(0, end), rtol=0, atol=0)


def test_a_reading_request_decodes_beside_a_plain_one_as_alone(tiny_engine):
    """In one batch, the plain request keeps its lone step's logits bit for bit (the native
    step where it runs) and the reading one its lone twin step's."""
    chunks = chunk_inputs(tiny_engine)
    config = _config(tiny_engine, 0.6, 0.8)

    def prefills():
        plain = tiny_engine.prefill(chunks, QUESTION, Mode.named("naive"), max_new_tokens=4)
        ape = tiny_engine.prefill(
            chunks, QUESTION, Mode.named("naive"), max_new_tokens=4, config=config, ape=True
        )
        return plain, ape

    plain, ape = prefills()
    lone_plain, lone_ape = prefills()
    with torch.inference_mode():
        together = decode_batch(tiny_engine.stack, [plain.cache, ape.cache], [7, 7])
        alone_plain = decode_batch(tiny_engine.stack, [lone_plain.cache], [7])
        alone_ape = decode_batch(tiny_engine.stack, [lone_ape.cache], [7])
    torch.testing.assert_close(together[0], alone_plain[0], rtol=0, atol=0)
    torch.testing.assert_close(together[1], alone_ape[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(together[0], together[1], rtol=1e-3, atol=1e-3)
    assert plain.cache.length == ape.cache.length == ape.layout.total_len + 1


@pytest.mark.parametrize(
    ("mode", "fidelity"),
    [
        ("naive", "balanced"),
        ("naive", "exact"),
        ("prefix", "fast"),
        ("cachecraft", "fast"),
        ("full", "fast"),
    ],
)
def test_only_fast_base_readers_may_ask(tiny_engine, mode, fidelity):
    with pytest.raises(InvalidRequest, match="ape"):
        tiny_engine.prefill(
            chunk_inputs(tiny_engine),
            QUESTION,
            Mode.named(mode),
            fidelity=Fidelity.named(fidelity),
            ape=True,
        )
