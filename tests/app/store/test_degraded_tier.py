"""A tier that cannot write (a full disk) is degraded: reported, passed by, rechecked, recovered."""

from __future__ import annotations

import pytest

from app.store import TieredStore, create_policy
from app.store.memory import CpuTier
from tests.app.store.faults import NO_SPACE, FullDisk
from tests.app.store.helpers import key_of, make_entry, same_entry

SIZE = make_entry(0).num_bytes


def make_store(tmp_path, retry_s: float, cpu_entries: int = 3) -> tuple[TieredStore, FullDisk]:
    disk = FullDisk(10 * SIZE, tmp_path / "kv", fsync=False)
    tiers = [CpuTier(cpu_entries * SIZE), disk]
    return TieredStore(tiers, create_policy("lru"), retry_s=retry_s), disk


def report(store, name):
    return next(r for r in store.stats() if r.name == name)


def test_a_failed_write_degrades_the_tier_and_later_puts_pass_it_by(tmp_path):
    store, disk = make_store(tmp_path, retry_s=3600)
    assert store.put(key_of("before"), make_entry(0), tier="disk") == "disk"
    disk.full = True
    assert store.put(key_of("a"), make_entry(1), tier="disk") is None
    disk_report = report(store, "disk")
    assert disk_report.state == "degraded" and disk_report.available
    assert NO_SPACE in disk_report.write_error
    assert disk_report.figures()["writable"] is False and disk_report.counters.put_failures == 1
    assert not list((tmp_path / "kv").rglob("*.tmp"))  # the torn temp file is gone
    assert store.put(key_of("b"), make_entry(2), tier="disk") is None
    assert disk.writes == 2  # not tried again
    assert store.put(key_of("b"), make_entry(2)) == "cpu"  # the other tiers still take writes
    assert same_entry(store.get(key_of("before")), make_entry(0))  # and it still serves reads
    store.close()


def test_evictions_are_dropped_rather_than_demoted_into_a_degraded_tier(tmp_path):
    store, disk = make_store(tmp_path, retry_s=3600, cpu_entries=1)
    disk.full = True
    assert store.put(key_of("probe"), make_entry(9), tier="disk") is None
    writes = disk.writes
    assert store.put(key_of("a"), make_entry(1)) == "cpu"
    assert store.put(key_of("b"), make_entry(2)) == "cpu"  # evicts a: not written to the full disk
    assert disk.writes == writes and store.where(key_of("a")) is None
    store.close()


def test_recheck_writes_finds_the_recovery(tmp_path):
    store, disk = make_store(tmp_path, retry_s=0)
    disk.full = True
    assert store.put(key_of("a"), make_entry(1), tier="disk") is None
    assert store.recheck_writes() == [] and report(store, "disk").state == "degraded"
    disk.full = False
    assert store.recheck_writes() == ["disk"] and report(store, "disk").state == "up"
    assert not list((tmp_path / "kv").glob(".probe-*"))  # the probe file is deleted
    store.close()


def test_persist_copies_a_memory_only_entry_once_the_tier_writes(tmp_path):
    store, disk = make_store(tmp_path, retry_s=0)
    store.put(key_of("a"), make_entry(1))
    disk.full = True
    assert store.persist(key_of("a"), "disk") is None
    disk.full = False
    assert store.persist(key_of("a"), "disk") is True and disk.contains(key_of("a"))
    assert store.persist(key_of("a"), "disk") is True  # already there
    assert store.persist(key_of("never stored"), "disk") is False
    assert report(store, "disk").state == "up"
    store.close()


@pytest.mark.parametrize("retry_s", [0, 3600])
def test_a_write_that_works_clears_the_error(tmp_path, retry_s):
    store, disk = make_store(tmp_path, retry_s=retry_s)
    disk.full = True
    store.put(key_of("a"), make_entry(1), tier="disk")
    disk.full = False
    stored = store.put(key_of("b"), make_entry(2), tier="disk")
    assert (stored == "disk") == (retry_s == 0)  # tried again only once its retry time has come
    assert (report(store, "disk").state == "up") == (retry_s == 0)
    store.close()
