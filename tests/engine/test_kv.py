"""engine/kv.py: a cache's copy holds its valid rows, at any capacity, and can be decoded from."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequest
from engine.kv import KVCache


def test_a_copy_holds_the_valid_rows_at_its_own_capacity_and_is_not_claimed():
    cache = KVCache(2, 3, 4, capacity=10, dtype=torch.float32, device=torch.device("cpu"))
    cache.data.normal_(generator=torch.Generator().manual_seed(0))
    cache.length = 6
    cache.claim_for_decode()
    for capacity, copy in ((10, cache.copy()), (16, cache.copy(16))):
        assert copy.capacity == capacity and copy.length == 6
        assert torch.equal(copy.data[..., :6, :], cache.data[..., :6, :])
        assert copy.data.data_ptr() != cache.data.data_ptr()
        copy.claim_for_decode()  # a fresh cache: not decoded from yet
    with pytest.raises(InvalidRequest):
        cache.claim_for_decode()
