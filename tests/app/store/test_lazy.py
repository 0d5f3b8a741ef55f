"""LazyChunkKV: layers read ahead in the background, skipped layers not waited for, bad layers
never returned."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from app.store import CorruptEntry, EntryReader, LazyChunkKV
from engine.kv import ChunkKV
from tests.app.store.helpers import make_entry

READ_S = 0.03


class SlowReader(EntryReader):
    """Takes READ_S per layer; records which layers were read and when; can fail a layer."""

    def __init__(self, entry, bad_layer: int | None = None):
        self.meta, self.entry, self.bad_layer = entry.meta, entry, bad_layer
        self.read: list[int] = []
        self.closed = False
        self.lock = threading.Lock()

    def layer(self, index):
        time.sleep(READ_S)
        with self.lock:
            self.read.append(index)
        if index == self.bad_layer:
            raise CorruptEntry(f"layer {index} checksum mismatch")
        return self.entry.kv[index]

    def close(self):
        self.closed = True


@pytest.fixture
def executor():
    pool = ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown(wait=True)


def test_layers_are_read_while_the_caller_computes(executor):
    entry = make_entry(1, layers=8)
    reader = SlowReader(entry)
    source = LazyChunkKV(reader, executor, torch.float32, prefetch=1)
    assert (source.num_tokens, source.base_position) == (
        entry.meta.num_tokens,
        entry.meta.base_position,
    )
    for index in range(8):
        layer = source.layer(index)
        assert layer.dtype == torch.float32 and torch.equal(layer, entry.kv[index].float())
        time.sleep(2 * READ_S)  # "compute" layer i while layer i + 1 is read
    source.close()
    assert reader.closed
    assert source.stats.layers_read == 8
    # Only the first layer is waited for in full; the rest were ready in time.
    assert source.stats.wait_s < 3 * READ_S < source.stats.load_s
    hidden = 1 - source.stats.wait_s / source.stats.load_s
    assert hidden > 0.6


def test_skipped_layers_are_not_waited_for(executor):
    entry = make_entry(2, layers=10)
    reader = SlowReader(entry)
    source = LazyChunkKV(reader, executor, torch.float16, prefetch=1)
    time.sleep(3 * READ_S)
    for index in (1, 6, 9):
        assert torch.equal(source.layer(index), entry.kv[index])
    source.close()
    assert set(reader.read) <= {0, 1, 2, 6, 7, 8, 9}


def test_corrupt_layer_switches_to_the_fallback(executor):
    entry = make_entry(3, layers=4)
    recomputed = ChunkKV(tuple(range(5)), entry.kv.float() + 1, 7, "fp-test", "prefix-test")
    reasons = []
    source = LazyChunkKV(
        SlowReader(entry, bad_layer=2),
        executor,
        torch.float32,
        fallback=lambda: recomputed,
        on_corrupt=reasons.append,
    )
    assert torch.equal(source.layer(1), entry.kv[1].float())
    assert torch.equal(source.layer(2), recomputed.kv[2])  # never the bad bytes
    assert torch.equal(source.layer(3), recomputed.kv[3])  # and the fallback from then on
    assert source.stats.fell_back and reasons == ["layer 2 checksum mismatch"]
    source.close()


def test_corrupt_layer_without_fallback_raises(executor):
    source = LazyChunkKV(SlowReader(make_entry(4, layers=3), bad_layer=0), executor, torch.float32)
    with pytest.raises(CorruptEntry):
        source.layer(0)
    source.close()
    with pytest.raises(RuntimeError):
        source.layer(1)


def test_close_waits_for_reads_in_flight(executor):
    reader = SlowReader(make_entry(5, layers=6))
    source = LazyChunkKV(reader, executor, torch.float32, prefetch=3)
    source.close()  # layers 0-1 are being read by the two workers: close waits for them
    count = len(reader.read)
    time.sleep(3 * READ_S)
    assert len(reader.read) == count and reader.closed
