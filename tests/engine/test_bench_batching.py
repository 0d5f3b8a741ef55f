"""The batching benchmark runs both ways on the tiny model and finds the same answers."""

from __future__ import annotations

from dataclasses import replace

from engine.bench.batching import PASSAGES, measure
from engine.engine import Engine
from engine.plan import ChunkInput


def test_measure_compares_batching_on_and_off(tiny_engine):
    off = Engine(replace(tiny_engine.config, batching=False), tiny_engine.loaded)
    chunks = [ChunkInput(i, ids, tiny_engine.encode_chunk(ids))
              for i, ids in enumerate(tiny_engine.chunk_ids(text) for text in PASSAGES[:3])]
    figures = measure(tiny_engine, off, chunks, concurrency=3, max_tokens=5, mode="naive", rounds=1)
    assert figures["same_answers"] is True
    assert figures["on"]["decode_tokens"] == figures["off"]["decode_tokens"] == 3 * 4
    for key in ("decode_speedup", "decode_cpu_speedup", "ttft_p95_ratio"):
        assert figures[key] > 0
