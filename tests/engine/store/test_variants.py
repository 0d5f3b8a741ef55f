"""Cache-Craft variants through the store and the catalog: choice by CFO, new variants, limits."""

from __future__ import annotations

import dataclasses

import torch

from engine.chunk_cache import ChunkRef
from tests.engine.helpers import QUESTION
from tests.engine.store.test_chunk_cache import catalog, make_cache, refs  # noqa: F401 (fixtures)


def craft_request(engine, cache, refs_in_order):
    chosen = cache.choose_variants([(r.chunk_id, r.token_ids) for r in refs_in_order])
    with cache.load(chosen) as loaded:
        result = engine.prefill(loaded.inputs, QUESTION, mode="cachecraft")
    return result, chosen


def test_a_request_leaves_variants_that_the_same_order_then_reuses(tiny_engine, catalog, refs, tmp_path):  # noqa: F811
    engine = tiny_engine
    cache = make_cache(engine, catalog, tmp_path)
    first, chosen = craft_request(engine, cache, refs)
    assert all(ref.context == () for ref in chosen)  # only base variants exist yet
    assert cache.put_context_variants(first) == len(refs) - 1
    for i, ref in enumerate(refs):
        contexts = {v.context for v in catalog.variants_of_chunk(ref.chunk_id)}
        assert contexts == ({(), tuple(str(r.chunk_id) for r in refs[:i])} if i else {()})
    second, chosen = craft_request(engine, cache, refs)
    assert [c.strategy for c in second.chunks] == ["reuse"] * len(refs)
    assert all(ref.stats is not None for ref in chosen[1:])
    full = engine.prefill([dataclasses.replace(i, kv=None) for i in []] or _plain(engine, refs), QUESTION, mode="full")
    # exact variants in fp16 storage: close to full prefill, and far closer than the base variants
    torch.testing.assert_close(second.logits, full.logits, rtol=0, atol=5e-2)
    assert cache.put_context_variants(second) == 0  # nothing new in this context
    cache.store.close()


def test_variants_per_chunk_are_capped_and_the_base_survives(tiny_engine, catalog, refs, tmp_path):  # noqa: F811
    engine = tiny_engine
    engine.config = dataclasses.replace(engine.config, craft_max_variants=2)
    try:
        cache = make_cache(engine, catalog, tmp_path)
        for order in (refs, refs[::-1], refs[1:] + refs[:1]):
            result, _ = craft_request(engine, cache, order)
            cache.put_context_variants(result)
        for ref in refs:
            variants = catalog.variants_of_chunk(ref.chunk_id)
            assert len(variants) <= 2 and any(v.context == () for v in variants)
            assert all(cache.store.where(v.store_key) is not None for v in variants)
    finally:
        engine.config = dataclasses.replace(engine.config, craft_max_variants=5)
        cache.store.close()


def _plain(engine, refs):
    from engine.planners.base import ChunkInput

    return [ChunkInput(str(r.chunk_id), r.token_ids) for r in refs]
