"""Slow checks on the real embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import pytest
import torch

from engine.decoding import read_out
from engine.model.decode import SamplingParams
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import QUESTION, chunk_inputs, kl

pytestmark = pytest.mark.slow


def test_embedded_model_is_converted_once_and_passes_the_selfcheck(smol_engine, smol_checkpoint):
    assert (smol_checkpoint / "model.safetensors").exists()
    assert not hasattr(smol_engine.loaded.model.config, "quantization_config")
    assert smol_engine.selfcheck.ok, smol_engine.selfcheck.message
    assert smol_engine.loaded.spec.num_layers == 30 and smol_engine.loaded.spec.num_kv_heads == 3


def test_fingerprint_is_stable_across_loads(smol_engine, test_data_dir):
    from engine.model.loader import load_model

    again = load_model(test_data_dir, None, "cpu", "float32")
    assert again.fingerprint == smol_engine.model_loaded.fingerprint


def test_full_equals_hugging_face_forward(smol_engine):
    result = smol_engine.prefill(
        chunk_inputs(smol_engine, cached=False), QUESTION, mode=Mode.named("full")
    )
    with torch.no_grad():
        reference = (
            smol_engine.loaded.model(result.layout.token_tensor()[None]).logits[0, -1].float()
        )
    torch.testing.assert_close(result.logits, reference, rtol=1e-3, atol=1e-3)


def test_greedy_decode_at_full_ratio_equals_generate(smol_engine):
    result = smol_engine.prefill(
        chunk_inputs(smol_engine),
        QUESTION,
        mode=Mode.named("cacheblend"),
        ratio=1.0,
        max_new_tokens=16,
    )
    _, decoded = read_out(smol_engine.generate(result, SamplingParams(max_new_tokens=16)))
    prompt = result.layout.token_tensor()[None]
    with torch.no_grad():
        reference = smol_engine.loaded.model.generate(prompt, max_new_tokens=16, do_sample=False)
    expected = [
        t
        for t in reference[0, prompt.shape[1] :].tolist()
        if t not in smol_engine.loaded.eos_token_ids
    ]
    assert list(decoded.token_ids) == expected


def test_cacheblend_is_closer_to_full_than_naive_on_musique(smol_engine, musique):
    for record in musique[:3]:
        chunks = []
        for i, ctx in enumerate(record["ctxs"][:3]):
            ids = smol_engine.chunk_ids(ctx["text"], ctx["title"])
            chunks.append(ChunkInput(i, ids, smol_engine.encode_chunk(ids)))
        full = smol_engine.prefill(chunks, record["question"], mode=Mode.named("full"))
        naive = smol_engine.prefill(chunks, record["question"], mode=Mode.named("naive"))
        blend = smol_engine.prefill(
            chunks, record["question"], mode=Mode.named("cacheblend"), ratio=0.15
        )
        assert kl(full.logits, blend.logits) < kl(full.logits, naive.logits)
