"""The one contract of `BaseTier`, run against every tier (cpu, disk, redis, gpu)."""

from __future__ import annotations

import pytest
import torch

from app.store import CorruptEntry, EntryPinned
from tests.app.store.helpers import key_of, make_entry, same_entry

A, B = key_of("a"), key_of("b")


def test_put_get_round_trip(tier):
    entry = make_entry(1)
    assert not tier.contains(A)
    tier.put(A, entry)
    assert tier.contains(A)
    assert same_entry(tier.get(A), entry)
    assert tier.keys() == {A: entry.num_bytes}
    assert tier.used_bytes() == entry.num_bytes


def test_absent_keys(tier):
    assert tier.get(A) is None
    assert tier.open(A) is None
    assert tier.get_layer(A, 0) is None
    assert tier.remove(A) is False
    assert tier.keys() == {} and tier.used_bytes() == 0


def test_put_replaces_and_accounts(tier):
    tier.put(A, make_entry(1, tokens=5))
    bigger = make_entry(2, tokens=9)
    tier.put(A, bigger)
    tier.put(B, make_entry(3))
    assert same_entry(tier.get(A), bigger)
    assert (
        tier.used_bytes() == bigger.num_bytes + make_entry(3).num_bytes == sum(tier.keys().values())
    )
    assert tier.remove(A) is True
    assert tier.used_bytes() == make_entry(3).num_bytes


def test_layer_at_a_time(tier):
    entry = make_entry(4, layers=5)
    tier.put(A, entry)
    with tier.open(A) as reader:
        assert reader.meta == entry.meta
        for index in (3, 0, 4, 3):  # any order, repeated
            assert torch.equal(reader.layer(index).cpu(), entry.kv[index])
    assert torch.equal(tier.get_layer(A, 2).cpu(), entry.kv[2])
    with pytest.raises(IndexError):
        tier.get_layer(A, 5)


# The one licensed refusal (EntryReader's contract): a reader opened before its entry is
# replaced or removed keeps reading the old bytes where the tier can keep them alive. Redis
# cannot (the value is overwritten or gone), so its reader must refuse with CorruptEntry
# rather than serve other bytes; every other tier must keep serving.
CANNOT_KEEP_AN_OPEN_ENTRY = {"redis"}


@pytest.mark.parametrize("change", ["replace", "remove"])
def test_reader_keeps_the_entry_it_opened(tier, change):
    old = make_entry(5)
    tier.put(A, old)
    with tier.open(A) as reader:
        if change == "replace":
            tier.put(A, make_entry(6))  # same shape: only the bytes differ
        else:
            tier.remove(A)
        for index in range(old.meta.num_layers):
            if tier.name in CANNOT_KEEP_AN_OPEN_ENTRY:
                with pytest.raises(CorruptEntry):
                    reader.layer(index)
            else:
                assert torch.equal(reader.layer(index).cpu(), old.kv[index])
    tier.remove(A)
    assert tier.open(A) is None


def test_pins(tier):
    tier.put(A, make_entry(7))
    tier.pin(A)
    tier.pin(A)
    assert tier.is_pinned(A) and tier.stats().num_pinned == 1
    with pytest.raises(EntryPinned):
        tier.remove(A)
    tier.unpin(A)
    with pytest.raises(EntryPinned):
        tier.remove(A)
    tier.unpin(A)
    assert tier.remove(A) is True
    with pytest.raises(ValueError):
        tier.unpin(A)
    tier.pin(B)  # pinning an absent key is allowed and protects it once it appears
    tier.put(B, make_entry(8))
    with pytest.raises(EntryPinned):
        tier.remove(B)
    tier.unpin(B)


def test_discard_ignores_pins(tier):
    """discard is remove without the pin check: the TieredStore keeps pins across tiers itself."""
    tier.put(A, make_entry(7))
    tier.pin(A)
    assert tier.discard(A) is True
    assert not tier.contains(A) and tier.get(A) is None and tier.used_bytes() == 0
    assert tier.discard(A) is False
    tier.unpin(A)


def test_stats(tier):
    tier.put(A, make_entry(1))
    tier.put(B, make_entry(2, tokens=3))
    stats = tier.stats()
    assert stats.name == tier.name
    assert stats.num_entries == 2 and stats.num_pinned == 0
    assert stats.used_bytes == make_entry(1).num_bytes + make_entry(2, tokens=3).num_bytes
    assert stats.capacity_bytes == tier.capacity_bytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_storage_dtypes(tier, dtype):
    entry = make_entry(9, dtype=dtype)
    tier.put(A, entry)
    got = tier.get(A)
    assert got.kv.dtype == entry.kv.dtype and same_entry(got, entry)


def test_keys_must_be_hex_digests(tier):
    for bad in ("../../etc/passwd", "ABCDEF0123456789", "short", "g" * 32):
        with pytest.raises(ValueError):
            tier.put(bad, make_entry(1))
