"""The tiered manager: capacity, eviction order per policy, pins, demotion, promotion, counters."""

from __future__ import annotations

import pytest

from app.store import EntryExpectation, TieredStore, create_policy
from app.store.disk import DiskTier
from app.store.memory import CpuTier
from app.store.redis import RedisTier
from tests.app.store.helpers import key_of, make_entry, same_entry

SIZE = make_entry(0).num_bytes  # every entry below has this size


def two_tiers(tmp_path, policy="lru", cpu_entries=3, disk_entries=10) -> TieredStore:
    tiers = [
        CpuTier(cpu_entries * SIZE),
        DiskTier(disk_entries * SIZE, tmp_path / "kv", fsync=False),
    ]
    return TieredStore(tiers, create_policy(policy))


@pytest.fixture
def store(tmp_path):
    store = two_tiers(tmp_path)
    yield store
    store.close()


def _fill(store, names):
    for i, name in enumerate(names):
        assert store.put(key_of(name), make_entry(i)) == "cpu"


def test_lru_evicts_least_recently_used_and_demotes_it(store):
    _fill(store, "abc")
    store.get(key_of("a"))
    store.put(key_of("d"), make_entry(3))
    cpu, disk = store.tier("cpu"), store.tier("disk")
    assert set(cpu.keys()) == {key_of("a"), key_of("c"), key_of("d")}
    assert set(disk.keys()) == {key_of("b")}
    assert same_entry(disk.get(key_of("b")), make_entry(1))  # the bytes moved down intact
    assert cpu.used_bytes() == 3 * SIZE and disk.used_bytes() == SIZE
    counters = {r.name: r.counters for r in store.stats()}
    assert counters["cpu"].evictions == 1 and counters["disk"].demotions == 1


def test_lfu_evicts_least_frequently_used(tmp_path):
    store = two_tiers(tmp_path, "lfu")
    _fill(store, "abc")
    for name, uses in (("a", 3), ("b", 1), ("c", 2)):
        for _ in range(uses):
            store.get(key_of(name))
    store.put(key_of("d"), make_entry(3))
    assert store.where(key_of("b")) == "disk"
    store.put(key_of("e"), make_entry(4))  # d has 0 uses now: it goes next
    assert store.where(key_of("d")) == "disk"
    store.close()


def test_value_policy_uses_savings_frequency_and_size(tmp_path):
    store = two_tiers(tmp_path, "value")
    _fill(store, "abc")
    store.set_usage(key_of("a"), savings=1.0)  # cheap to recompute
    store.set_usage(key_of("b"), savings=50.0)
    store.set_usage(key_of("c"), savings=5.0, access_count=20)  # 5 x 21 > 50 x 1
    store.put(key_of("d"), make_entry(3))
    assert store.where(key_of("a")) == "disk"
    store.set_usage(key_of("d"), savings=1000.0)
    store.put(key_of("e"), make_entry(4))  # b (50 x 1) is now the least valuable
    assert store.where(key_of("b")) == "disk"
    store.put(key_of("f"), make_entry(5))  # e's default savings: its 5 tokens x 1
    assert store.where(key_of("e")) == "disk"
    assert {store.where(key_of(n)) for n in "cdf"} == {"cpu"}
    store.close()


def test_pinned_entries_survive(store):
    _fill(store, "abc")
    for name in "abc":
        store.pin(key_of(name))
    assert store.put(key_of("d"), make_entry(3)) == "disk"  # no room in cpu: next tier
    assert all(store.where(key_of(n)) == "cpu" for n in "abc")
    store.unpin(key_of("a"))
    assert store.put(key_of("e"), make_entry(4)) == "cpu"
    assert store.where(key_of("a")) == "disk"


def test_dropped_from_the_last_tier_and_oversized_entries(tmp_path):
    store = two_tiers(tmp_path, cpu_entries=1, disk_entries=1)
    assert store.put(key_of("a"), make_entry(0)) == "cpu"
    assert store.put(key_of("b"), make_entry(1)) == "cpu"  # a -> disk
    assert store.put(key_of("c"), make_entry(2)) == "cpu"  # b -> disk, a dropped
    assert store.where(key_of("a")) is None and store.where(key_of("b")) == "disk"
    assert store.put(key_of("big"), make_entry(3, tokens=50)) is None  # fits nowhere
    store.pin(key_of("c"))
    store.pin(key_of("b"))
    assert store.put(key_of("d"), make_entry(4)) is None  # everything pinned
    store.close()


def test_promotion_on_hit_and_counters(store):
    entry = make_entry(1)
    assert store.put(key_of("a"), entry, tier="disk") == "disk"
    assert store.get(key_of("zz")) is None
    got = store.get(key_of("a"))
    assert same_entry(got, entry)
    assert store.tier("cpu").contains(key_of("a")) and store.tier("disk").contains(key_of("a"))
    store.get(key_of("a"))
    counters = {r.name: r.counters for r in store.stats()}
    assert counters["disk"].hits == 1 and counters["cpu"].hits == 1
    assert counters["cpu"].misses == 2 and counters["disk"].misses == 1
    assert counters["cpu"].promotions == 1
    assert counters["disk"].bytes_read == SIZE and counters["cpu"].bytes_written == SIZE


def test_open_counts_and_promote_later(store):
    store.put(key_of("a"), make_entry(1), tier="disk")
    opened = store.open(key_of("a"))
    assert opened.tier == "disk"
    opened.reader.layer(0)
    opened.reader.close()
    assert store.promote(key_of("a")) is True and store.where(key_of("a")) == "cpu"
    assert store.promote(key_of("a")) is False
    report = {r.name: r for r in store.stats()}["disk"]
    assert report.counters.hits == 1 and report.counters.bytes_read == SIZE // 3


def test_lookups_count_each_tier_passed_and_promotion_counts_nothing(store):
    """get and open: a miss in every tier passed, a hit in the one found; promote: neither."""
    store.put(key_of("a"), make_entry(1), tier="disk")
    before = store.usage(key_of("a")).access_count
    assert store.promote(key_of("a")) is True
    assert _hits_and_misses(store) == {"cpu": (0, 0), "disk": (0, 0)}
    assert store.usage(key_of("a")).access_count == before
    store.open(key_of("a")).reader.close()
    store.get(key_of("a"))
    assert store.open(key_of("zz")) is None
    assert _hits_and_misses(store) == {"cpu": (2, 1), "disk": (0, 1)}
    # get counts the whole entry read; open counts only the layers read (none here)
    assert {r.name: r.counters for r in store.stats()}["cpu"].bytes_read == SIZE
    assert store.usage(key_of("a")).access_count == before + 2


def _hits_and_misses(store):
    return {r.name: (r.counters.hits, r.counters.misses) for r in store.stats()}


def test_wrong_model_is_a_miss_and_is_removed(store):
    store.put(key_of("a"), make_entry(1, fingerprint="other-model"), tier="disk")
    expect = EntryExpectation("fp-test", "prefix-test", f"{1:064x}")
    assert store.get(key_of("a"), expect) is None
    assert store.open(key_of("a"), expect) is None
    assert store.where(key_of("a")) is None
    assert {r.name: r for r in store.stats()}["disk"].counters.corrupt == 1


def test_remove_of_a_pinned_key_waits_for_unpin(store):
    store.put(key_of("a"), make_entry(1))
    store.pin(key_of("a"))
    assert store.remove(key_of("a")) is True
    assert store.where(key_of("a")) == "cpu"
    store.unpin(key_of("a"))
    assert store.where(key_of("a")) is None


def test_listener_hears_moves_and_drops(tmp_path):
    store = two_tiers(tmp_path, cpu_entries=1, disk_entries=1)
    events = []

    class Listener:
        def entry_moved(self, key, tier):
            events.append(("moved", key, tier))

        def entry_dropped(self, key):
            events.append(("dropped", key))

    store.subscribe(Listener())
    store.put(key_of("a"), make_entry(0))
    store.put(key_of("b"), make_entry(1))
    store.put(key_of("c"), make_entry(2))
    assert events == [
        ("moved", key_of("a"), "disk"),
        ("dropped", key_of("a")),
        ("moved", key_of("b"), "disk"),
    ]
    store.close()


def test_unreachable_redis_is_skipped(tmp_path, caplog):
    redis_tier = RedisTier(10 * SIZE, "redis://127.0.0.1:1/0", timeout_s=0.2, check=False)
    store = TieredStore(
        [CpuTier(SIZE), redis_tier, DiskTier(10 * SIZE, tmp_path / "kv", fsync=False)], retry_s=60
    )
    assert "redis" not in store.live_names() and "unavailable" in caplog.text
    store.put(key_of("a"), make_entry(0))
    store.put(key_of("b"), make_entry(1))  # a is demoted past redis, to disk
    assert store.where(key_of("a")) == "disk"
    assert same_entry(store.get(key_of("a")), make_entry(0))  # promoted back, b demoted
    report = {r.name: r for r in store.stats()}
    assert report["redis"].available is False and report["disk"].used_bytes == 2 * SIZE
    assert store.where(key_of("a")) == "cpu" and store.where(key_of("b")) == "disk"
    store.close()


@pytest.mark.redis
def test_redis_sits_between_cpu_and_disk(tmp_path, redis_prefix):
    from tests.app.store.conftest import REDIS_URL

    store = TieredStore(
        [
            CpuTier(SIZE),
            RedisTier(SIZE, REDIS_URL, redis_prefix),
            DiskTier(10 * SIZE, tmp_path / "kv", fsync=False),
        ]
    )
    for i, name in enumerate("abc"):
        store.put(key_of(name), make_entry(i))
    assert [store.where(key_of(n)) for n in "abc"] == ["disk", "redis", "cpu"]
    assert same_entry(store.get(key_of("a")), make_entry(0))
    store.close()


def test_admin_evict_and_clear(store):
    _fill(store, "abc")
    store.pin(key_of("c"))
    assert store.evict("cpu", num_bytes=SIZE) == (1, SIZE)  # the least recently used one
    assert store.where(key_of("a")) == "disk"
    assert store.evict("cpu") == (1, SIZE)  # all unpinned: only b is left to go
    assert store.where(key_of("b")) == "disk" and store.where(key_of("c")) == "cpu"
    assert store.clear() == sorted(key_of(n) for n in "abc")
    assert store.where(key_of("c")) == "cpu"  # pinned: removed at its last unpin
    store.unpin(key_of("c"))
    assert store.locations() == {}
