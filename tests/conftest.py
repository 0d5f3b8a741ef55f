"""Shared fixtures: a tiny random-weight Llama for exact checks, the real SmolLM2 for slow ones.

Model files live in one test data dir (`KVMOSAIC_TEST_DATA`, default `.cache/test-data` in
the repo), so the embedded GGUF is converted once per machine, not once per test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# float32 wherever a test names no dtype, in this process and the servers it starts: on a CPU
# with AMX-BF16, `auto` is bfloat16, whose products round differently with the row count, and
# the exactness tests compare modes bit for bit (bfloat16 and `auto` have their own tests)
os.environ.setdefault("KVMOSAIC_DTYPE", "float32")

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = Path(os.environ.get("KVMOSAIC_TEST_DATA", REPO / ".cache" / "test-data"))
MUSIQUE = Path(
    os.environ.get(
        "KVMOSAIC_MUSIQUE", REPO.parent / "shared" / "data" / "cacheblend" / "musique_s.json"
    )
)
# The first records of the same file, shipped with the tests (see tests/data/NOTICE).
MUSIQUE_SLICE = REPO / "tests" / "data" / "musique_first3.json"


@pytest.fixture(scope="session")
def test_data_dir() -> Path:
    TEST_DATA.mkdir(parents=True, exist_ok=True)
    return TEST_DATA


@pytest.fixture(scope="session")
def smol_checkpoint(test_data_dir) -> Path:
    """The embedded SmolLM2 converted to safetensors (converted on first use, then cached)."""
    from engine.model.loader import embedded_checkpoint

    return embedded_checkpoint(test_data_dir)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_checkpoint, local_files_only=True)


def build_tiny_model(vocab_size: int, seed: int = 0, **overrides):
    """A random-weight Llama with a few small layers; weights scaled up so attention is peaked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    with torch.no_grad():  # std 0.02 gives near-uniform attention; make the test sharper
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_loaded(smol_tokenizer):
    from engine.model.loader import wrap_model

    return wrap_model(build_tiny_model(len(smol_tokenizer)), smol_tokenizer)


@pytest.fixture(scope="session")
def tiny_engine(tiny_loaded, tmp_path_factory):
    from engine import EngineConfig
    from engine.engine import Engine

    # fidelity "fast": tests see each mode as it is; the guard has its own tests (test_guard.py).
    # encode_dtype "engine": base KV in the engine's own dtype, so that exactness tests hold on
    # any CPU (bfloat16 encoding has its own tests in test_encoder.py)
    return Engine(
        EngineConfig(
            data_dir=tmp_path_factory.mktemp("tiny"),
            epic_tokens=4,
            fidelity="fast",
            encode_dtype="engine",
        ),
        tiny_loaded,
    )


@pytest.fixture(scope="session")
def smol_engine(test_data_dir, smol_checkpoint):
    from engine import EngineConfig
    from engine.engine import Engine

    return Engine.load(
        EngineConfig(
            data_dir=test_data_dir, dtype="float32", fidelity="fast", encode_dtype="engine"
        )
    )  # modes as they are, in float32 (the exactness tests compare bit for bit)


@pytest.fixture(scope="session")
def musique() -> list[dict]:
    import json

    return json.loads((MUSIQUE if MUSIQUE.exists() else MUSIQUE_SLICE).read_text())


@pytest.fixture(scope="session")
def embedder():
    """The real MiniLM embedder, loaded once for the session (service and benchmark tests)."""
    from retrieval.embedder import Embedder

    return Embedder()
