"""Every model family the engine accepts, against transformers; every refusal, with its message.

Each row of FAMILIES (tests/engine/tiny_families.py) is a tiny random-weight model of its own
config class, saved and loaded through `engine.model.loader.load_model`. For each: full prefill
equals transformers' forward, greedy decode equals `generate`, a chunk's KV re-rotated to
another position equals KV computed there, naive on one chunk and cacheblend at r = 1 equal
full, and both start-up self-checks pass. docs/models.md tabulates the same rows.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine import EngineConfig, PromptTooLong
from engine.decoding import read_out
from engine.engine import Engine
from engine.errors import UnsupportedModel
from engine.kv import ChunkKV
from engine.model import ops
from engine.model.decode import SamplingParams
from engine.model.families import check_architecture
from engine.model.layers import DecoderStack
from engine.model.loader import load_model, wrap_model
from engine.model.selfcheck import rope_shift_selfcheck
from engine.plan import ChunkInput
from engine.planners import Mode
from tests.engine.helpers import PASSAGES, QUESTION, chunk_inputs
from tests.engine.tiny_families import (
    FAMILIES,
    MISTRAL,
    Family,
    build_model,
    build_tokenizer,
    save_checkpoint,
)

TOL = dict(rtol=1e-4, atol=1e-4)
# what each family's chat template puts around the passages (its own markers)
TEMPLATE_MARKS = {
    "llama": (
        "<|start_header_id|>system<|end_header_id|>",
        "<|start_header_id|>assistant<|end_header_id|>",
    ),
    "mistral": ("[INST]", "[/INST]"),
    "qwen2": ("<|im_start|>system", "<|im_start|>assistant\n"),
    "qwen3": ("<|im_start|>system", "<|im_start|>assistant\n<think>\n\n</think>"),
}


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def family_engine(request, tmp_path_factory):
    family: Family = request.param
    directory = save_checkpoint(family, tmp_path_factory.mktemp("families") / family.name)
    loaded = load_model(directory.parent, str(directory), "cpu", "float32")
    config = EngineConfig(data_dir=directory.parent, fidelity="fast", encode_dtype="engine")
    engine = Engine(config, loaded)
    yield family, engine
    engine.close()


def hf_logits(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine.loaded.model(ids[None]).logits[0, -1].float()


# -- the matrix ---------------------------------------------------------------------------------


def test_checkpoint_loads_as_its_own_family(family_engine):
    family, engine = family_engine
    model = engine.loaded.model
    assert model.config.model_type == family.model_type
    assert model.config.rope_parameters["rope_type"] == family.rope_type
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == (family.model_type == "qwen2")
    assert hasattr(attn, "k_norm") == (family.model_type == "qwen3")
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == bool(model.config.tie_word_embeddings)


def test_rope_scaling_is_in_effect(family_engine):
    """The scaled rows rotate by other frequencies than plain RoPE (dynamic only past its
    context), and YaRN scales cos and sin by its attention factor: the matrix tests them."""
    family, engine = family_engine
    head_dim = engine.loaded.spec.head_dim
    plain = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaled = family.rope_type not in ("default", "dynamic")
    assert torch.allclose(engine.stack.inv_freq, plain) != scaled
    assert (engine.stack.rotary.attention_scaling > 1.0) == (family.rope_type == "yarn")


def test_full_prefill_equals_transformers_forward(family_engine):
    _, engine = family_engine
    result = engine.prefill(chunk_inputs(engine, cached=False), QUESTION, mode=Mode.named("full"))
    reference = hf_logits(engine, result.layout.token_tensor())
    torch.testing.assert_close(result.logits, reference, **TOL)


def test_greedy_decode_equals_transformers_generate(family_engine):
    _, engine = family_engine
    chunks = chunk_inputs(engine, cached=False)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("full"), max_new_tokens=12)
    _, decoded = read_out(engine.generate(result, SamplingParams(max_new_tokens=12)))
    prompt = result.layout.token_tensor()[None]
    with torch.no_grad():
        reference = engine.loaded.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = reference[0, prompt.shape[1] :].tolist()
    eos = set(engine.loaded.eos_token_ids)
    cut = next((i for i, t in enumerate(expected) if t in eos), len(expected))
    assert list(decoded.token_ids) == expected[:cut]
    assert len(list(decoded.token_ids)) > 0


def test_chunk_kv_computed_alone_and_moved_equals_kv_computed_there(family_engine):
    """Layer 0 isolates RoPE: a chunk's K from its base position, re-rotated to where it sits
    in the prompt, equals the K that full prefill computes there (V needs no move)."""
    _, engine = family_engine
    chunks = chunk_inputs(engine)
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    for chunk, (start, end) in list(zip(chunks, full.layout.chunk_spans))[1:]:
        moved = chunk.kv.layer(0).clone()  # [2, kv_heads, n, head_dim]
        ops.rope_shift_(moved[0], start - chunk.kv.base_position, engine.stack.inv_freq)
        torch.testing.assert_close(moved, full.cache.data[0, :, :, start:end], **TOL)


def test_naive_with_kv_moved_back_and_forth_equals_full(family_engine):
    """Every layer: each chunk's KV from full prefill, rotated back to the base position, then
    placed again by naive reuse (which rotates it forward) gives full's logits."""
    _, engine = family_engine
    chunks = chunk_inputs(engine, cached=False)
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    base, moved = engine.prompts.prefix_len, []
    for i, (chunk, (start, end)) in enumerate(zip(chunks, full.layout.chunk_spans)):
        rows = full.cache.rows(start, end)
        ops.rope_shift_(rows[:, 0], base - start, engine.stack.inv_freq)
        kv = ChunkKV(
            chunk.token_ids,
            rows,
            base,
            engine.fingerprint,
            engine.prompts.prefix_digest,
            context=tuple(c.chunk_id for c in chunks[:i]),
        )
        moved.append(ChunkInput(chunk.chunk_id, chunk.token_ids, kv))
    naive = engine.prefill(moved, QUESTION, mode=Mode.named("naive"))
    assert naive.recomputed_tokens == 0
    torch.testing.assert_close(naive.logits, full.logits, **TOL)


def test_packed_encoder_equals_encoding_each_chunk_alone(family_engine):
    """Ingest encodes base KV packed (engine/model/encoder.py): the same KV as one chunk at a
    time."""
    _, engine = family_engine
    ids = [engine.chunk_ids(text, title) for title, text in PASSAGES]
    for packed, token_ids in zip(engine.encode_chunks(ids), ids):
        torch.testing.assert_close(packed.kv, engine.encode_chunk(token_ids).kv, **TOL)


def test_naive_on_one_chunk_equals_full(family_engine):
    _, engine = family_engine
    chunks = chunk_inputs(engine, PASSAGES[:1])
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    naive = engine.prefill(chunks, QUESTION, mode=Mode.named("naive"))
    assert naive.mode.name == "naive" and naive.recomputed_tokens == 0
    torch.testing.assert_close(naive.logits, full.logits, **TOL)


def test_cacheblend_at_ratio_one_equals_full(family_engine):
    _, engine = family_engine
    chunks = chunk_inputs(engine)
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    blend = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"), ratio=1.0)
    assert blend.mode.name == "cacheblend"
    torch.testing.assert_close(blend.logits, full.logits, **TOL)
    n = full.layout.total_len
    torch.testing.assert_close(blend.cache.data[:, :, :, :n], full.cache.data[:, :, :, :n], **TOL)


def test_startup_selfchecks_pass(family_engine):
    _, engine = family_engine
    assert engine.selfcheck is not None and engine.selfcheck.ok, engine.selfcheck
    assert engine.reuse_available
    assert engine.tokenization.ok, engine.tokenization.message


def test_prompt_follows_the_family_chat_template(family_engine):
    family, engine = family_engine
    layout = engine.prompts.layout([engine.chunk_ids("Passage.")], "Why?")
    text = engine.loaded.tokenizer.decode(layout.token_tensor())
    opening, closing = TEMPLATE_MARKS[family.model_type]
    prefix = engine.loaded.tokenizer.decode(list(layout.prefix_ids))
    # the system prompt, in the system turn or merged into the user's
    assert opening in prefix and "Be brief." in prefix
    assert text.rstrip().endswith(closing.rstrip()) and "Passage.\n\nQuestion: Why?" in text
    bos = engine.loaded.tokenizer.bos_token
    assert bos is None or text.startswith(bos)


# -- config.json as checkpoints ship it (transformers 4 keys: rope_scaling, "type") ------------

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
SHIPPED_CONFIGS = {
    "Llama-3.1": (
        dict(
            model_type="llama",
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        "llama, rope llama3",
    ),
    "Qwen2.5 long context": (
        dict(
            model_type="qwen2",
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            sliding_window=131072,
            use_sliding_window=False,
            max_window_layers=21,
            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
        ),
        "qwen2, rope yarn",
    ),
    "Mistral-7B v0.3": (
        dict(
            model_type="mistral",
            max_position_embeddings=32768,
            sliding_window=None,
            rope_theta=1000000.0,
        ),
        "mistral, rope default",
    ),
    "Mistral-7B v0.1": (
        dict(model_type="mistral", max_position_embeddings=32768, sliding_window=4096),
        "sliding-window attention in 2 of 2 layers",
    ),
    "longrope": (
        dict(
            model_type="llama",
            max_position_embeddings=1024,
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0] * 8,
                long_factor=[2.0] * 8,
                original_max_position_embeddings=256,
            ),
        ),
        "RoPE type 'longrope' is not supported",
    ),
}


@pytest.mark.parametrize("name", list(SHIPPED_CONFIGS))
def test_config_files_as_checkpoints_ship_them_are_read_the_same_way(tmp_path, name):
    """Accepted with the RoPE type they name, or refused with the reason (as the loader does)."""
    from transformers import AutoConfig

    settings, expected = SHIPPED_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **settings}))
    config = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    if expected.startswith(settings["model_type"] + ","):
        assert check_architecture(config) == expected
    else:
        with pytest.raises(UnsupportedModel, match=expected):
            check_architecture(config)


# -- what is refused, and why -----------------------------------------------------------------


def write_config(directory, model_type: str, **settings) -> str:
    """A checkpoint folder holding only config.json: refusals must come before any weight is
    read."""
    from transformers import AutoConfig

    directory.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(model_type, **settings).save_pretrained(directory)
    return str(directory)


def test_dynamic_rope_keeps_the_context_to_its_original_length(tmp_path):
    family = next(f for f in FAMILIES if f.rope_type == "dynamic")
    tokenizer = build_tokenizer(family.tokenizer)
    loaded = wrap_model(build_model(family, tokenizer), tokenizer)
    engine = Engine(EngineConfig(data_dir=tmp_path, fidelity="fast", batching=False), loaded)
    assert loaded.spec.max_positions == loaded.model.config.max_position_embeddings
    long_chunk = ChunkInput(0, tuple([5] * loaded.spec.max_positions))
    with pytest.raises(PromptTooLong, match="exceeds the model's context"):
        engine.prefill([long_chunk], QUESTION, mode=Mode.named("full"))


def test_selfcheck_refuses_dynamic_rope_probed_past_its_original_length():
    """Past max_position_embeddings dynamic NTK recomputes its frequencies from the length, so
    re-rotated K is wrong there: the self-check sees it (and the engine never goes there)."""
    family = next(f for f in FAMILIES if f.rope_type == "dynamic")
    tokenizer = build_tokenizer(family.tokenizer)
    loaded = wrap_model(build_model(family, tokenizer), tokenizer)
    spec = dataclasses.replace(loaded.spec, max_positions=4 * loaded.spec.max_positions)
    wide = dataclasses.replace(loaded, spec=spec)
    result = rope_shift_selfcheck(DecoderStack(wide))
    assert not result.ok
    assert "does not compose, so KV reuse is off" in result.message


def test_mistral_with_a_sliding_window_shorter_than_its_context_is_refused_at_load(tmp_path):
    """Mistral-7B v0.1: sliding_window 4096 in a 32k context."""
    path = write_config(
        tmp_path / "mistral-v0.1",
        "mistral",
        sliding_window=4096,
        max_position_embeddings=32768,
        hidden_size=64,
        num_hidden_layers=2,
    )
    expected = (
        r"sliding-window attention in 2 of 2 layers \(window 4096 < context 32768\)"
        r".*set max_position_embeddings to at most 4096"
    )
    with pytest.raises(UnsupportedModel, match=expected):
        load_model(tmp_path, path, "cpu", "float32")


def test_a_window_as_long_as_the_context_is_no_sliding_window():
    from transformers import MistralConfig

    config = MistralConfig(sliding_window=1024, max_position_embeddings=1024)
    assert check_architecture(config).startswith("mistral")


def test_qwen_sliding_window_layers_are_refused():
    from transformers import Qwen2Config

    config = Qwen2Config(
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=256,
        max_window_layers=3,
        max_position_embeddings=1024,
    )
    expected = r"sliding-window attention in 1 of 4 layers.*use_sliding_window false"
    with pytest.raises(UnsupportedModel, match=expected):
        check_architecture(config)
    no_window_layers = Qwen2Config(
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=256,
        max_window_layers=4,
        max_position_embeddings=1024,
    )
    assert check_architecture(no_window_layers).startswith("qwen2")


@pytest.mark.parametrize(
    "model_type,reason",
    [
        ("gemma2", "alternates sliding-window and global layers"),
        ("gemma3_text", "alternates sliding-window and global layers"),
        ("gemma", "scales embeddings"),
        ("mixtral", "mixture of experts"),
        ("gpt2", "Llama-layout decoders only"),
    ],
)
def test_unsupported_model_types_are_refused_at_load_with_the_reason(tmp_path, model_type, reason):
    path = write_config(tmp_path / model_type, model_type)
    expected = (
        rf"model type '{model_type}' is not supported: .*{reason}.*"
        r"Use a checkpoint of a supported family \(llama, mistral, qwen2, qwen3"
    )
    with pytest.raises(UnsupportedModel, match=expected):
        load_model(tmp_path, path, "cpu", "float32")


def test_a_model_type_transformers_does_not_know_is_refused_the_same_way(tmp_path):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "made_up_lm"}))
    with pytest.raises(UnsupportedModel, match="model type 'made_up_lm' is not supported"):
        load_model(tmp_path, str(tmp_path / "odd"), "cpu", "float32")


def test_a_rope_type_whose_rotation_depends_on_length_is_refused_at_load(tmp_path):
    half = 8  # head_dim 16 / 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * half,
        "long_factor": [2.0] * half,
        "original_max_position_embeddings": 256,
    }
    path = write_config(
        tmp_path / "longrope",
        "llama",
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_parameters=rope,
    )
    expected = (
        r"RoPE type 'longrope' is not supported: .*re-rotating K.*"
        r"Supported RoPE types: default, linear, llama3, yarn, dynamic"
    )
    with pytest.raises(UnsupportedModel, match=expected):
        load_model(tmp_path, path, "cpu", "float32")


def test_partial_rotary_embedding_is_refused():
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope)
    with pytest.raises(UnsupportedModel, match="partial_rotary_factor 0.5 is not supported"):
        check_architecture(config)


# -- the tokenization self-check ------------------------------------------------------------------


def test_tokenization_selfcheck_names_the_boundary_that_differs():
    """A SentencePiece-style tokenizer prepends "▁" to each text it encodes: without the
    anchor (engine/prompt.py) every piece would start with a space; the check says where."""
    from engine.model.selfcheck import tokenization_selfcheck
    from engine.prompt import PromptBuilder

    builder = PromptBuilder(build_tokenizer(MISTRAL), "Be brief.", "Read the passages.")
    assert tokenization_selfcheck(builder).ok
    builder._encode_piece = builder._encode  # pieces tokenized with no anchor
    result = tokenization_selfcheck(builder)
    assert not result.ok
    assert "at the boundary system prefix | chunk 1" in result.message
    assert "'▁Ada'" in result.message
