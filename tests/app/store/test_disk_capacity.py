"""The disk tier holds to its capacity from start-up, not only from the next write."""

from __future__ import annotations

import os

from app.store.disk import DiskTier
from tests.app.store.helpers import key_of, make_entry


def test_a_restart_with_a_smaller_capacity_removes_the_oldest_files(tmp_path, caplog):
    entries = [(key_of(f"e{i}"), make_entry(seed=i)) for i in range(5)]
    size = entries[0][1].num_bytes
    tier = DiskTier(10 * size, tmp_path, fsync=False)
    for age, (key, entry) in enumerate(entries):
        tier.put(key, entry)
        os.utime(tier.path(key), (1_000_000 + age, 1_000_000 + age))  # written in this order
    assert tier.used_bytes() == 5 * size

    again = DiskTier(2 * size + size // 2, tmp_path, fsync=False)  # the cap was lowered

    assert again.used_bytes() == 2 * size <= again.capacity_bytes
    assert sorted(again.keys()) == sorted(key for key, _ in entries[3:])  # the newest two stay
    assert sorted(p.name for p in tmp_path.glob("*/*.kvs")) == sorted(
        f"{key}.kvs" for key, _ in entries[3:]
    )
    assert "removed the 3 oldest entries" in caplog.text


def test_a_tier_within_its_capacity_keeps_every_file(tmp_path):
    tier = DiskTier(1 << 20, tmp_path, fsync=False)
    for i in range(3):
        tier.put(key_of(f"k{i}"), make_entry(seed=i))
    assert len(DiskTier(tier.used_bytes(), tmp_path, fsync=False).keys()) == 3
