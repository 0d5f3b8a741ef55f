"""Cache-Craft variants through the store and the catalog: choice by CFO, new variants, limits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.variants.harvest import source_contexts
from engine.planners import Mode
from tests.app.kvcache.test_chunk_cache import catalog, make_cache, refs  # noqa: F401 (fixtures)
from tests.engine.helpers import QUESTION


def craft_request(engine, cache, refs_in_order, mode="cachecraft"):
    chosen = cache.variants.choose(
        Mode.named(mode), [(r.chunk_id, r.token_ids) for r in refs_in_order]
    )
    with cache.loader.load(chosen) as loaded:
        result = engine.prefill(loaded.inputs, QUESTION, mode=Mode.named(mode))
    return result, chosen, loaded.inputs


def contexts_of(chosen):
    return [tuple(ref.context) for ref in chosen]


def test_a_request_leaves_variants_that_the_same_order_then_reuses(
    tiny_engine,
    catalog,  # noqa: F811
    refs,  # noqa: F811
    tmp_path,
):
    engine = tiny_engine
    cache = make_cache(engine, catalog, tmp_path)
    first, chosen, _ = craft_request(engine, cache, refs)
    assert all(ref.context == () for ref in chosen)  # only base variants exist yet
    assert cache.variants.build(first, contexts_of(chosen)) == len(refs) - 1
    for i, ref in enumerate(refs):
        contexts = {v.context for v in catalog.variants_of_chunk(ref.chunk_id)}
        assert contexts == ({(), tuple(r.chunk_id for r in refs[:i])} if i else {()})
    second, chosen, _ = craft_request(engine, cache, refs)
    assert [c.strategy for c in second.chunks] == ["reuse"] * len(refs)
    assert all(ref.stats is not None for ref in chosen[1:])
    full = engine.prefill(
        [dataclasses.replace(i, kv=None) for i in []] or _plain(engine, refs),
        QUESTION,
        mode=Mode.named("full"),
    )
    # exact variants in fp16 storage: close to full prefill, and far closer than the base variants
    torch.testing.assert_close(second.logits, full.logits, rtol=0, atol=5e-2)
    assert cache.variants.build(second, contexts_of(chosen)) == 0  # nothing new in this context
    cache.store.close()


def test_variants_per_chunk_are_capped_and_the_base_survives(
    tiny_engine,
    catalog,  # noqa: F811
    refs,  # noqa: F811
    tmp_path,
):
    engine = tiny_engine
    engine.config = dataclasses.replace(engine.config, craft_max_variants=2)
    try:
        cache = make_cache(engine, catalog, tmp_path)
        for order in (refs, refs[::-1], refs[1:] + refs[:1]):
            result, chosen, _ = craft_request(engine, cache, order)
            cache.variants.build(result, contexts_of(chosen))
        for ref in refs:
            variants = catalog.variants_of_chunk(ref.chunk_id)
            assert len(variants) <= 2 and any(v.context == () for v in variants)
            assert all(cache.store.where(v.store_key) is not None for v in variants)
    finally:
        engine.config = dataclasses.replace(engine.config, craft_max_variants=5)
        cache.store.close()


def _plain(engine, refs):  # noqa: F811
    from engine.plan import ChunkInput

    return [ChunkInput(r.chunk_id, r.token_ids) for r in refs]


def test_prefix_keeps_what_it_computed_and_a_repeated_prompt_reuses_all_of_it(
    tiny_engine,
    catalog,  # noqa: F811
    refs,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    engine = tiny_engine
    cache = make_cache(engine, catalog, tmp_path)
    first, chosen, inputs = craft_request(engine, cache, refs, mode="prefix")
    assert first.recomputed_tokens == first.context_tokens - len(
        refs[0].token_ids
    )  # only the first chunk was exact
    runs = []
    monkeypatch.setattr(engine.runner, "run", lambda *a, **k: runs.append(1))
    assert cache.variants.harvest(first, inputs) == len(refs) - 1
    assert not runs  # keeping them cost no model work
    monkeypatch.undo()
    second, chosen, inputs = craft_request(engine, cache, refs, mode="prefix")
    assert [tuple(ref.context) for ref in chosen] == [
        tuple(r.chunk_id for r in refs[:i]) for i in range(len(refs))
    ]
    assert second.recomputed_tokens == 0
    torch.testing.assert_close(second.logits, first.logits, rtol=0, atol=5e-2)
    assert cache.variants.harvest(second, inputs) == 0
    cache.store.close()


def test_base_only_modes_leave_nothing(
    tiny_engine,
    catalog,  # noqa: F811
    refs,  # noqa: F811
    tmp_path,
):
    cache = make_cache(tiny_engine, catalog, tmp_path)
    result, _, inputs = craft_request(tiny_engine, cache, refs, mode="cacheblend")
    assert cache.variants.harvest(result, inputs) == 0
    assert not cache.variants.policy.should_build(
        Mode.named("cacheblend"), [r.chunk_id for r in refs]
    )
    assert all(len(catalog.variants_of_chunk(r.chunk_id)) == 1 for r in refs)
    cache.store.close()


def test_savings_follow_what_a_variant_actually_saved(
    tiny_engine,
    catalog,  # noqa: F811
    refs,  # noqa: F811
    tmp_path,
):
    engine = tiny_engine
    cache = make_cache(engine, catalog, tmp_path)
    first, chosen, _ = craft_request(engine, cache, refs)
    cache.variants.build(first, contexts_of(chosen))
    last = refs[-1]
    [variant] = [v for v in catalog.variants_of_chunk(last.chunk_id) if v.context]
    assert variant.stats.expected_savings == pytest.approx(
        cache.variants.policy.prior_savings(len(last.token_ids))
    )
    again, chosen, inputs = craft_request(engine, cache, refs)  # exact reuse: nothing recomputed
    cache.variants.record_savings(again, inputs)
    used = catalog.get_variant(variant.store_key)
    assert used.access_count == 1
    assert used.stats.expected_savings == pytest.approx(
        len(last.token_ids) * cache.variants.policy.blend_cost
    )
    assert cache.store.usage(variant.store_key).savings == pytest.approx(
        used.stats.expected_savings
    )
    cache.store.close()


def test_inline_builds_through_the_store(
    tiny_engine,
    catalog,  # noqa: F811
    refs,  # noqa: F811
    tmp_path,
):
    engine = tiny_engine
    original = engine.config
    engine.config = dataclasses.replace(original, craft_build="inline", fidelity="fast")
    try:
        cache = make_cache(engine, catalog, tmp_path)
        first, chosen, _ = craft_request(engine, cache, refs)
        assert not any(ref.compute for ref in chosen)  # seen once: not worth computing exactly
        second, chosen, inputs = craft_request(engine, cache, refs)
        assert [ref.compute for ref in chosen] == [False] + [True] * (len(refs) - 1)
        assert all(i.kv is None for i in inputs[1:])
        assert cache.variants.harvest(second, inputs) == len(refs) - 1
        third, chosen, _ = craft_request(engine, cache, refs)
        assert third.recomputed_tokens == 0 and not any(ref.compute for ref in chosen)
        torch.testing.assert_close(third.logits, second.logits, rtol=0, atol=5e-2)
    finally:
        engine.config = original
        cache.store.close()


@pytest.mark.parametrize("variant_codec, float_copies", [("auto", True), ("int8", False)])
def test_under_a_lossy_store_exact_variants_stay_exact_in_float16_unless_told(
    tiny_engine,
    catalog,  # noqa: F811
    refs,  # noqa: F811
    tmp_path,
    variant_codec,
    float_copies,
):
    engine = tiny_engine
    cache = make_cache(engine, catalog, tmp_path, codec="int8", variant_codec=variant_codec)
    first, chosen, inputs = craft_request(engine, cache, refs, mode="prefix")
    assert all(c.kv.value_rounding is not None for c in inputs)  # int8 bases
    assert first.guard.margin is not None  # over a lossy prefix the state is not exact: judged
    assert cache.variants.harvest(first, inputs) == 0  # nor are the rows computed after it
    first, chosen, inputs = craft_request(engine, cache, refs)
    # the first chunk's exact rows too: as a float16 copy of its base, or not at all
    assert cache.variants.build(first, source_contexts(inputs)) == len(refs) - (not float_copies)
    stored_as = "float16" if float_copies else "int8"
    for i, ref in enumerate(refs):
        kept = sorted(
            (tuple(v.context), v.storage_dtype) for v in catalog.variants_of_chunk(ref.chunk_id)
        )
        wanted = (
            [((), "int8"), (tuple(r.chunk_id for r in refs[:i]), stored_as)]
            if i
            else [((), "int8")]
        )
        assert kept == sorted(wanted + ([((), "float16")] if i == 0 and float_copies else []))
    second, chosen, inputs = craft_request(engine, cache, refs)
    assert contexts_of(chosen) == [tuple(r.chunk_id for r in refs[:i]) for i in range(len(refs))]
    assert [c.kv.value_rounding is None for c in inputs] == [float_copies] * len(refs)
    # float copies: the state is exact, nothing to judge; int8 ones: judged
    assert (second.guard.margin is None) == float_copies
    if float_copies:
        full = engine.prefill(_plain(engine, refs), QUESTION, mode=Mode.named("full"))
        torch.testing.assert_close(second.logits, full.logits, rtol=0, atol=5e-2)
        copy = next(
            v for v in catalog.variants_of_chunk(refs[0].chunk_id) if v.storage_dtype == "float16"
        )
        cache.store.remove(copy.store_key)  # evicted: the int8 base serves again
        with cache.loader.load([refs[0]]) as loaded:
            assert loaded.inputs[0].kv.value_rounding is not None and not loaded.computed
    cache.store.close()


def test_a_variant_codec_must_be_auto_or_a_known_codec():
    from app.store import StoreConfig

    assert StoreConfig(codec="ch4v3").context_variant_codec == "float16"
    assert StoreConfig(codec="bfloat16").context_variant_codec == "bfloat16"
    assert StoreConfig(codec="ch4v3", variant_codec="h4v3").context_variant_codec == "h4v3"
    with pytest.raises(ValueError, match="variant_codec"):
        StoreConfig(variant_codec="fp8")


def test_the_store_codec_auto_follows_the_model_s_dtype():
    """`auto` stores a 16-bit model's KV in its own dtype (exact) and a float32 model's in
    float16; an explicit codec is kept; an unresolved `auto` cannot name a variant codec."""
    from app.store import StoreConfig

    assert StoreConfig().codec == "auto"
    assert StoreConfig().for_model("bfloat16").codec == "bfloat16"
    assert StoreConfig().for_model("float16").codec == "float16"
    assert StoreConfig().for_model("float32").codec == "float16"
    assert StoreConfig(codec="k4v3").for_model("bfloat16").codec == "k4v3"
    assert StoreConfig().for_model("bfloat16").context_variant_codec == "bfloat16"
    with pytest.raises(ValueError, match="for_model"):
        _ = StoreConfig().context_variant_codec
