"""Slow checks on the real Qwen2.5-Coder-1.5B-Instruct weights (`kvmosaic models pull
qwen2.5-coder-1.5b`), which set-up does not pull (its float32 checkpoint is several GB): these
tests skip when it is not installed in the data dir (`KVMOSAIC_DATA_DIR`, default `data/`).

What they check once on the larger model: the pinned checkpoint's shapes, the start-up
self-checks, full prefill against transformers' forward, a greedy answer that reads the passage,
and that `balanced` runs exact-first under the model's committed reuse profile (equal to full).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine import EngineConfig
from engine.config import Fidelity
from engine.decoding import read_out
from engine.engine import Engine
from engine.model.decode import SamplingParams
from engine.model.known import QWEN_CODER_15B, checkpoint_dir, is_installed
from engine.planners import Mode
from engine.serving.profile import known_path
from tests.conftest import REPO
from tests.engine.helpers import QUESTION, chunk_inputs

pytestmark = pytest.mark.slow

DATA_DIR = REPO / os.environ.get("KVMOSAIC_DATA_DIR", "data")
TOL = dict(rtol=1e-3, atol=1e-3)  # 28 float32 layers row-wise against whole-prompt products


@pytest.fixture(scope="module")
def qwen15() -> Engine:
    if not is_installed(DATA_DIR, QWEN_CODER_15B):
        pytest.skip(
            f"{QWEN_CODER_15B.name} is not installed in {DATA_DIR / 'models'} "
            f"(`kvmosaic models pull {QWEN_CODER_15B.name}`; set-up does not pull it)"
        )
    engine = Engine.load(
        EngineConfig(
            data_dir=DATA_DIR,
            model=QWEN_CODER_15B.name,
            dtype="float32",
            encode_dtype="engine",
            decode_weights="model",
            batching=False,
        )
    )
    yield engine
    engine.close()


def test_the_pulled_checkpoint_is_the_pinned_qwen2_of_28_layers(qwen15):
    source = json.loads((checkpoint_dir(DATA_DIR, QWEN_CODER_15B) / "source.json").read_text())
    assert source["sha256"] == QWEN_CODER_15B.source.sha256
    spec = qwen15.loaded.spec
    assert qwen15.loaded.model.config.model_type == "qwen2" and spec.num_layers == 28
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (1536, 12, 2)
    assert qwen15.loaded.model.config.rope_parameters["rope_theta"] == 1e6
    assert qwen15.selfcheck is not None and qwen15.selfcheck.ok, qwen15.selfcheck.message


def test_full_prefill_equals_transformers_and_the_answer_reads_the_passage(qwen15):
    result = qwen15.prefill(chunk_inputs(qwen15, cached=False), QUESTION, mode=Mode.named("full"))
    with torch.no_grad():
        reference = qwen15.loaded.model(result.layout.token_tensor()[None]).logits[0, -1].float()
    torch.testing.assert_close(result.logits, reference, **TOL)
    text, _ = read_out(qwen15.generate(result, SamplingParams(max_new_tokens=8)))
    assert "Lovelace" in text


def test_balanced_runs_exact_first_under_its_committed_profile(qwen15):
    assert qwen15.profile.source == str(known_path(QWEN_CODER_15B.name))
    chunks = chunk_inputs(qwen15)
    full = qwen15.prefill(chunks, QUESTION, mode=Mode.named("full"))
    balanced = qwen15.prefill(
        chunks, QUESTION, mode=Mode.named("cachecraft"), fidelity=Fidelity.BALANCED
    )
    if qwen15.profile.balanced_modes:
        pytest.skip("the committed profile passed a blend: exact-first is not in force")
    assert balanced.guard.exact_first
    assert int(balanced.logits.argmax()) == int(full.logits.argmax())
    torch.testing.assert_close(balanced.logits, full.logits, **TOL)
