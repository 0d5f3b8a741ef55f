"""The work meter counts every layer-row any run of the engine computed."""

from __future__ import annotations

import threading

import torch

from engine.config import Fidelity
from engine.engine import Engine
from engine.model.work import WorkMeter, WorkTotals, work_of
from engine.plan import ChunkInput
from engine.planners import Mode


def test_work_of_weights_rows_by_the_keys_they_see():
    assert work_of(torch.tensor([2, 0, 1])) == WorkTotals(1, 3, 2 * 1 + 0 * 2 + 1 * 3)


def test_meter_sums_runs_across_threads():
    meter = WorkMeter()
    workers = [
        threading.Thread(
            target=lambda: [meter.add(torch.ones(4, dtype=torch.long)) for _ in range(50)]
        )
        for _ in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert meter.snapshot() == WorkTotals(200, 800, 200 * 10)


def test_engine_meters_prefills_and_chunk_encodes(tiny_engine: Engine):
    layers = tiny_engine.loaded.spec.num_layers
    meter = tiny_engine.runner.meter
    before = meter.snapshot()
    kv = tiny_engine.encode_chunk(tiny_engine.chunk_ids("A short passage about tide mills."))
    encoded = meter.snapshot() - before
    assert (encoded.runs, encoded.layer_rows) == (1, kv.num_tokens * layers)
    result = tiny_engine.prefill(
        [ChunkInput(0, kv.token_ids, kv)], "When was it built?", mode=Mode.named("full")
    )
    full = meter.snapshot() - before - encoded
    assert full.runs == 1 and full.layer_rows == result.layout.total_len * layers
    assert full == work_of(result.layers_computed)
    before = meter.snapshot()
    naive = tiny_engine.prefill(
        [ChunkInput(0, kv.token_ids, kv)],
        "When was it built?",
        mode=Mode.named("naive"),
        fidelity=Fidelity.named("fast"),
    )
    assert meter.snapshot() - before == work_of(naive.layers_computed)
    assert work_of(naive.layers_computed).layer_rows < full.layer_rows


def test_work_on_a_marked_thread_is_also_background():
    from engine.model.work import mark_background_thread

    meter = WorkMeter()
    meter.add(torch.ones(3, dtype=torch.long))

    def builder():
        mark_background_thread()
        meter.add(torch.ones(2, dtype=torch.long))

    thread = threading.Thread(target=builder)
    thread.start()
    thread.join()
    assert meter.snapshot() == WorkTotals(2, 5, 6 + 3)
    assert meter.background_snapshot() == WorkTotals(1, 2, 3)


def test_batched_chunk_encodes_are_metered_like_single_ones(tiny_engine: Engine):
    chunks = [
        tiny_engine.chunk_ids("A short passage about tide mills."),
        tiny_engine.chunk_ids("Bees dance."),
    ]
    meter = tiny_engine.runner.meter
    before = meter.snapshot()
    for ids in chunks:
        tiny_engine.encode_chunk(ids)
    one_by_one = meter.snapshot() - before
    before = meter.snapshot()
    tiny_engine.encode_chunks(chunks)
    assert meter.snapshot() - before == one_by_one
