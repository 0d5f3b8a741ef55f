"""Slow checks on the real Qwen2.5-Coder-0.5B-Instruct weights, pulled by `scripts/setup.sh`
(`kvmosaic models pull qwen2.5-coder-0.5b`) into the data dir (`KVMOSAIC_DATA_DIR`, default
`data/`): the engine against transformers on the same token ids, as the tiny families are
checked (tests/engine/test_families.py), once on weights whose answers mean something.

A missing model fails these tests (CI installs it); `KVMOSAIC_SKIP_REAL_QWEN=1` skips them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine import EngineConfig
from engine.decoding import read_out
from engine.engine import Engine
from engine.kv import ChunkKV
from engine.model import ops
from engine.model.decode import SamplingParams, generate_ids
from engine.model.known import QWEN_CODER, checkpoint_dir, is_installed, rounded_decode_weights
from engine.model.layers import DecoderStack
from engine.plan import ChunkInput
from engine.planners import Mode
from engine.serving.threads import in_own_thread
from tests.conftest import REPO
from tests.engine.helpers import PASSAGES, QUESTION, chunk_inputs

pytestmark = pytest.mark.slow

DATA_DIR = REPO / os.environ.get("KVMOSAIC_DATA_DIR", "data")  # an absolute one stays as is
# 24 float32 layers computed row-wise against transformers' whole-prompt products
TOL = dict(rtol=1e-3, atol=1e-3)


def hf_logits(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine.loaded.model(ids[None]).logits[0, -1].float()


@pytest.fixture(scope="module")
def qwen() -> Engine:
    if not is_installed(DATA_DIR, QWEN_CODER):
        reason = (
            f"{QWEN_CODER.name} is not installed in {DATA_DIR / 'models'}: run scripts/setup.sh "
            f"or `kvmosaic models pull {QWEN_CODER.name}` (KVMOSAIC_SKIP_REAL_QWEN=1 skips these)"
        )
        if os.environ.get("KVMOSAIC_SKIP_REAL_QWEN") == "1":
            pytest.skip(reason)
        pytest.fail(reason)
    engine = Engine.load(
        EngineConfig(
            data_dir=DATA_DIR,
            model=QWEN_CODER.name,
            dtype="float32",
            fidelity="fast",
            encode_dtype="engine",
            decode_weights="model",  # the model's own weights: decode equals transformers'
        )
    )
    yield engine
    engine.close()


def test_the_pulled_checkpoint_is_the_pinned_qwen2(qwen):
    source = json.loads((checkpoint_dir(DATA_DIR, QWEN_CODER) / "source.json").read_text())
    assert source["sha256"] == QWEN_CODER.source.sha256
    spec, model = qwen.loaded.spec, qwen.loaded.model
    assert model.config.model_type == "qwen2" and spec.num_layers == 24
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (896, 14, 2)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.rope_parameters["rope_theta"] == 1e6
    im_end = qwen.loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in qwen.loaded.eos_token_ids


def test_startup_selfchecks_pass(qwen):
    assert qwen.selfcheck is not None and qwen.selfcheck.ok, qwen.selfcheck.message
    assert qwen.reuse_available
    assert qwen.tokenization.ok, qwen.tokenization.message


def test_full_prefill_first_token_logits_equal_transformers_forward(qwen):
    result = qwen.prefill(chunk_inputs(qwen, cached=False), QUESTION, mode=Mode.named("full"))
    reference = hf_logits(qwen, result.layout.token_tensor())
    torch.testing.assert_close(result.logits, reference, **TOL)
    assert int(result.logits.argmax()) == int(reference.argmax())


def test_greedy_decode_equals_transformers_generate_and_answers(qwen):
    result = qwen.prefill(chunk_inputs(qwen, cached=False), QUESTION, mode=Mode.named("full"))
    _, decoded = read_out(qwen.generate(result, SamplingParams(max_new_tokens=8)))
    prompt = result.layout.token_tensor()[None]
    with torch.no_grad():
        reference = qwen.loaded.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=list(qwen.loaded.eos_token_ids),
            pad_token_id=qwen.loaded.eos_token_ids[0],
        )
    expected = reference[0, prompt.shape[1] :].tolist()
    eos = set(qwen.loaded.eos_token_ids)
    cut = next((i for i, t in enumerate(expected) if t in eos), len(expected))
    assert list(decoded.token_ids) == expected[:cut]
    # a model that answers: the passage's author, which SmolLM2 often misses
    assert "Lovelace" in qwen.loaded.tokenizer.decode(list(decoded.token_ids))


def test_auto_decodes_with_the_measured_int8_and_still_answers(qwen):
    dtype = str(qwen.loaded.dtype).removeprefix("torch.")
    rounded = rounded_decode_weights(QWEN_CODER.name, None, dtype)
    stack = DecoderStack(qwen.loaded, qwen.stack.decode_attention, "auto", rounded)
    if stack.native_unfit is not None:
        pytest.skip(f"the native decode step cannot run here: {stack.native_unfit}")
    result = qwen.prefill(chunk_inputs(qwen, cached=False), QUESTION, mode=Mode.named("full"))
    params = SamplingParams(max_new_tokens=8)
    eos = qwen.loaded.eos_token_ids
    ids = in_own_thread(lambda: list(generate_ids(stack, result.cache, result.logits, params, eos)))
    assert stack.native is not None and stack.native.weights == rounded == "int8"
    assert "Lovelace" in qwen.loaded.tokenizer.decode(ids)


def test_chunk_kv_moved_to_a_new_position_equals_kv_computed_there(qwen):
    """Layer 0: a chunk's K computed alone at the base position and re-rotated to where it sits
    equals full prefill's K there. Every layer: full's KV of each chunk rotated back to the base
    and placed again by `naive` gives full's logits."""
    chunks = chunk_inputs(qwen, PASSAGES[:3])
    full = qwen.prefill(chunks, QUESTION, mode=Mode.named("full"))
    inv_freq = qwen.stack.inv_freq
    for chunk, (start, end) in list(zip(chunks, full.layout.chunk_spans))[1:]:
        moved = chunk.kv.layer(0).clone()  # [2, kv_heads, n, head_dim]
        ops.rope_shift_(moved[0], start - chunk.kv.base_position, inv_freq)
        torch.testing.assert_close(moved, full.cache.data[0, :, :, start:end], **TOL)
    base, placed = qwen.prompts.prefix_len, []
    for i, (chunk, (start, end)) in enumerate(zip(chunks, full.layout.chunk_spans)):
        rows = full.cache.rows(start, end)
        ops.rope_shift_(rows[:, 0], base - start, inv_freq)
        kv = ChunkKV(
            chunk.token_ids,
            rows,
            base,
            qwen.fingerprint,
            qwen.prompts.prefix_digest,
            context=tuple(c.chunk_id for c in chunks[:i]),
        )
        placed.append(ChunkInput(chunk.chunk_id, chunk.token_ids, kv))
    naive = qwen.prefill(placed, QUESTION, mode=Mode.named("naive"))
    assert naive.recomputed_tokens == 0
    torch.testing.assert_close(naive.logits, full.logits, **TOL)
