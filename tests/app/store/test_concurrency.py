"""Threads hammering the same keys with put / get / open / evict / remove / pin for a few
seconds: no exception, no torn entry, exact byte accounting afterwards."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from app.store import TieredStore, create_policy
from app.store.disk import DiskTier, open_layout
from app.store.memory import CpuTier
from tests.app.store.helpers import key_of, make_entry, same_entry

DURATION_S = 2.5
NUM_KEYS = 6
SIZE = make_entry(0).num_bytes


def _expected(index: int):
    return make_entry(index)  # the content under key i is always entry i


def _worker(store: TieredStore, seed: int, stop: threading.Event, errors: list) -> None:
    rng = random.Random(seed)
    try:
        while not stop.is_set():
            index = rng.randrange(NUM_KEYS)
            key = key_of(f"k{index}")
            action = rng.random()
            if action < 0.35:
                store.put(key, _expected(index), tier=rng.choice([None, "disk"]))
            elif action < 0.65:
                got = store.get(key)
                if got is not None and not same_entry(got, _expected(index)):
                    errors.append(f"torn entry under {key}")
            elif action < 0.8:
                store.pin(key)
                try:
                    opened = store.open(key)
                    if opened is not None:
                        with opened.reader as reader:
                            layer = rng.randrange(reader.meta.num_layers)
                            if not (reader.layer(layer).cpu() == _expected(index).kv[layer]).all():
                                errors.append(f"torn layer under {key}")
                finally:
                    store.unpin(key)
            elif action < 0.9:
                store.remove(key)
            else:
                store.promote(key)
    except Exception as exc:  # reported by the test
        errors.append(repr(exc))


def _disk_file_bytes(tier: DiskTier) -> int:
    total = 0
    for path in tier.directory.glob("*/*.kvs"):
        fd = os.open(path, os.O_RDONLY)
        try:
            total += open_layout(fd).meta.num_bytes
        finally:
            os.close(fd)
    return total


@pytest.mark.parametrize("policy", ["lru", "value"])
def test_concurrent_put_get_evict(tmp_path, policy):
    cpu, disk = CpuTier(2 * SIZE), DiskTier(3 * SIZE, tmp_path / "kv", fsync=False)
    store = TieredStore([cpu, disk], create_policy(policy), load_threads=2)
    stop, errors = threading.Event(), []
    threads = [
        threading.Thread(target=_worker, args=(store, seed, stop, errors)) for seed in range(4)
    ]
    for thread in threads:
        thread.start()
    time.sleep(DURATION_S)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    for tier in (cpu, disk):
        assert tier.used_bytes() == sum(tier.keys().values()) <= tier.capacity_bytes
        assert not any(tier.is_pinned(k) for k in tier.keys())
    assert disk.used_bytes() == _disk_file_bytes(disk)
    assert not list(disk.directory.glob("*/.*.tmp"))
    assert sum(r.counters.puts for r in store.stats()) > 10  # the test did real work
    store.close()
