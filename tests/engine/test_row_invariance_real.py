"""The embedded SmolLM2's and Qwen2.5-Coder-0.5B's reused exact prefix and ingested chunk KV
against full prefill, bit for bit, per dtype and linear kernel (the tiny model's shapes hide what
real ones show).

MKL's float32 products on an Intel CPU and oneDNN's bfloat16 products on AMX round a row
differently with the number of rows computed together (`kvmosaic bench invariance`,
docs/benchmarks/bfloat16.md "Row invariance"); prefill's row tiles (engine/model/row_tiles.py)
make every case here pass: without them float32 on torch's kernel failed on an Intel CPU and
bfloat16 on AMX.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.variants.harvest import chunk_rows
from engine import EngineConfig
from engine.engine import Engine
from engine.model.known import QWEN_CODER, is_installed
from engine.planners import Mode
from engine.serving.thread_bits import threads_change_bits
from engine.serving.threads import in_own_thread
from tests.engine.helpers import QUESTION, chunk_inputs
from tests.engine.test_qwen_real import DATA_DIR

pytestmark = pytest.mark.slow

CASES = [
    pytest.param((None, "float32", "torch"), id="smollm2-float32-torch"),
    pytest.param((None, "float32", "onednn"), id="smollm2-float32-onednn"),
    pytest.param((None, "bfloat16", "auto"), id="smollm2-bfloat16"),
    pytest.param((QWEN_CODER.name, "float32", "auto"), id="qwen-float32"),
    pytest.param((QWEN_CODER.name, "bfloat16", "auto"), id="qwen-bfloat16"),
]


@pytest.fixture(scope="module", params=CASES)
def engine(request, test_data_dir, smol_checkpoint) -> Engine:
    model, dtype, kernel = request.param
    if model is not None and not is_installed(DATA_DIR, QWEN_CODER):
        pytest.skip(
            f"{model} is not installed in {DATA_DIR / 'models'} (scripts/setup.sh pulls it)"
        )
    return Engine.load(
        EngineConfig(
            data_dir=test_data_dir if model is None else DATA_DIR,
            model=model,
            dtype=dtype,
            linear_kernel=kernel,
            fidelity="fast",
            encode_dtype="engine",
        )
    )


def test_a_reused_prefix_and_ingested_kv_are_full_prefill_bit_for_bit(engine):
    chunks = chunk_inputs(engine)
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    total = full.layout.total_len
    start, end = full.layout.chunk_spans[0]
    assert torch.equal(chunks[0].kv.kv, full.cache.rows(start, end))
    other = engine.prefill(chunks[:3], "Which river?", mode=Mode.named("full"))
    exact = [dataclasses.replace(chunks[i], kv=chunk_rows(engine, other, i)) for i in (1, 2)]
    prefix = engine.prefill([chunks[0], *exact, *chunks[3:]], QUESTION, mode=Mode.named("prefix"))
    assert torch.equal(prefix.cache.rows(0, total), full.cache.rows(0, total))
    assert torch.equal(prefix.logits, full.logits)


def test_kv_computed_on_one_thread_is_full_prefill_on_two_bit_for_bit(engine):
    """The variant builder computes exact variants on one CPU thread, full prefill runs on the
    compute thread's count: where the load-time probe finds one thread's bits on two
    (engine/serving/thread_bits.py), the whole prefill must give them too (where it does not,
    the count is in the fingerprint and builds run on it: tests/engine/test_thread_bits.py)."""
    if threads_change_bits(engine.loaded.model, 2):
        pytest.skip("this CPU's products depend on the thread count; the engine names it")
    chunks = chunk_inputs(engine)

    def full(threads: int):
        return in_own_thread(
            lambda: engine.prefill(chunks, QUESTION, mode=Mode.named("full")), threads=threads
        )

    one, two = full(1), full(2)
    total = two.layout.total_len
    assert torch.equal(one.cache.rows(0, total), two.cache.rows(0, total))
    assert torch.equal(one.logits, two.logits)
