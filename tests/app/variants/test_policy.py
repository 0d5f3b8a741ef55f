"""The one variant policy: what each mode may use, the blend cost it weighs CFOs against, what
chunks keep, when builds repay, and which rows of a request are exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.variants.book import VariantBook
from app.variants.harvest import exact_chunks, source_contexts
from app.variants.policy import VariantPolicy, blend_cost
from app.variants.traffic import RecentTraffic
from engine.cachecraft.choice import Candidate
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import UnknownMode
from engine.planners import PLANNERS, Mode
from engine.planners.base import VariantUse, VariantYield
from engine.planners.cacheblend import blend_schedule
from engine.variant_stats import VariantStats
from tests.engine.helpers import QUESTION, chunk_inputs

LAYERS = 30


def policy(**changes) -> VariantPolicy:
    return VariantPolicy(EngineConfig(**changes), LAYERS)


def measured(context, cci=0.8):
    return Candidate(tuple(context), VariantStats(cci=cci, inter_scores={c: 1.0 for c in context}))


@pytest.fixture
def engine(tiny_loaded, tmp_path):
    # "fast": no fidelity guard, so each mode runs exactly its own plan
    return Engine(EngineConfig(data_dir=tmp_path, focus_layer=None, fidelity="fast"), tiny_loaded)


def test_every_mode_declares_its_policy():
    for cls in PLANNERS.values():
        assert isinstance(cls.variant_use, VariantUse) and isinstance(cls.leaves, VariantYield)
    assert (PLANNERS["prefix"].variant_use, PLANNERS["prefix"].leaves) == (
        VariantUse.EXACT,
        VariantYield.HARVEST,
    )
    assert (PLANNERS["cachecraft"].variant_use, PLANNERS["cachecraft"].leaves) == (
        VariantUse.BEST,
        VariantYield.BUILD,
    )
    assert not policy().uses_variants(Mode.named("full")) and not policy().uses_variants(
        Mode.named("cacheblend")
    )
    with pytest.raises(UnknownMode):
        policy().choose(Mode.named("nope"), ["a"], [[Candidate(())]])


def test_blend_cost_counts_the_rows_of_each_layer():
    # r = 0.13, checks at layers 1, 2 and 6 keeping 3r, 2r, r: layer 0 all, 1 → 0.39, 2-5 → 0.26,
    # 6.. → 0.13
    assert blend_cost(EngineConfig(), LAYERS) == pytest.approx(
        (1 + 0.39 + 4 * 0.26 + 24 * 0.13) / LAYERS
    )
    two_checks = EngineConfig(check_layers=(1, 2), check_ratio_multipliers=(2.0, 1.0))
    assert blend_cost(two_checks, LAYERS, 0.15) == pytest.approx((1 + 0.3 + 28 * 0.15) / LAYERS)
    assert blend_cost(
        EngineConfig(check_layers=(1,), check_ratio_multipliers=(1.0,)), 4, 0.5
    ) == pytest.approx((1 + 3 * 0.5) / 4)


def test_a_shallow_model_keeps_the_ratio_from_its_last_check():
    config = EngineConfig()  # checks at 1, 2 and 6 keeping 3r, 2r, r
    assert blend_schedule(config, 0.1, LAYERS) == pytest.approx({1: 0.3, 2: 0.2, 6: 0.1})
    # a 4-layer model has no layer 6: it checks at 1 and 2 and still ends at r
    assert blend_schedule(config, 0.1, 4) == pytest.approx({1: 0.2, 2: 0.1})
    assert blend_cost(config, 4, 0.1) == pytest.approx((1 + 0.2 + 2 * 0.1) / 4)


def test_blend_cost_is_what_a_cacheblend_prefill_computes(engine):
    chunks = chunk_inputs(engine)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    cost = blend_cost(engine.config, engine.loaded.spec.num_layers)
    computed = sum(c.compute_share * c.tokens for c in result.chunks) / result.context_tokens
    assert computed == pytest.approx(cost, abs=0.02)  # rounding up per check layer


def test_each_use_gets_what_its_mode_may_use():
    ids = ["a", "b", "c"]
    candidates = [
        [Candidate(())],
        [Candidate(()), measured(["a"])],
        [measured(["b", "a"]), Candidate(()), measured(["a", "b"])],
    ]
    assert policy().choose(Mode.named("cacheblend"), ids, candidates) == [None, None, None]
    assert policy().choose(Mode.named("prefix"), ids, candidates) == [None, 1, 2]
    assert policy().choose(Mode.named("cachecraft"), ids, candidates) == [None, 1, 2]
    # prefix takes only the exact context; cachecraft takes a close one when cheaper than blending
    other = [[Candidate(())], [Candidate(())], [Candidate(()), measured(["b", "a"])]]
    assert policy().choose(Mode.named("prefix"), ids, other) == [None, None, None]
    assert policy(craft_alpha=0.1).choose(Mode.named("cachecraft"), ids, other) == [None, None, 1]


def test_an_unrelated_or_stale_variant_loses_to_the_base_plus_blend():
    p = policy(craft_alpha=1.0)
    ids = ["a", "b", "c", "d"]
    unrelated = [Candidate(()), measured(["x", "y", "z"])]
    shuffled = [Candidate(()), measured(["c", "b", "a"])]  # the same chunks, order fully reversed
    close = [Candidate(()), measured(["a", "b", "x"], cci=0.6)]
    chosen = p.choose(Mode.named("cachecraft"), ids, [[Candidate(())]] * 3 + [unrelated])
    assert chosen[-1] is None
    assert p.choose(Mode.named("cachecraft"), ids, [[Candidate(())]] * 3 + [shuffled])[-1] is None
    assert (
        p.choose(Mode.named("cachecraft"), ["a", "b", "q", "d"], [[Candidate(())]] * 3 + [close])[
            -1
        ]
        is None
    )
    # with α small enough the same unrelated variant would win (CFO 0.08 < blend cost)
    assert (
        policy(craft_alpha=0.1).choose(
            Mode.named("cachecraft"), ids, [[Candidate(())]] * 3 + [unrelated]
        )[-1]
        == 1
    )


def test_the_full_recompute_branch_is_reachable_at_the_default_alpha():
    from engine.cachecraft.choice import variant_cfo

    config = EngineConfig()
    value = variant_cfo(
        measured(["x"], cci=0.9), ["a", "b"], config.craft_alpha, config.craft_novelty
    )
    assert value > config.craft_full_above


def test_chunks_keep_the_variants_chosen_most_and_saving_most():
    p = policy()
    base = Candidate((), num_bytes=100)
    popular = Candidate(("a",), uses=5, savings=40.0, num_bytes=100)
    unused = Candidate(("b",), uses=0, savings=40.0, num_bytes=100)
    useless = Candidate(("c",), uses=9, savings=0.0, num_bytes=100)
    assert p.keep([useless, base, unused, popular], limit=2) == [1, 3]
    assert p.keep([useless, base, unused, popular], limit=3) == [1, 2, 3]
    assert p.keep([base, popular], limit=1) == [0]  # the base variant always stays
    assert p.updated_savings(None, 0, 12.0) == 12.0 and p.updated_savings(10.0, 3, 2.0) == 8.0
    assert p.saved(100, 0.0) == pytest.approx(100 * p.blend_cost) and p.saved(100, 1.0) == 0.0


def test_recent_traffic_counts_sets_in_any_order_within_its_window():
    traffic = RecentTraffic(window=2)
    assert traffic.observe(["a", "b"]) == 0
    assert traffic.observe(["b", "a"]) == 1
    assert traffic.observe(["c"]) == 0  # pushes the first {a, b} out
    assert traffic.seen(["a", "b"]) == 1
    with pytest.raises(ValueError):
        RecentTraffic(0)


def test_builds_only_for_modes_that_build_and_sets_that_recur():
    p = policy(craft_build_after=1)
    p.choose(Mode.named("cachecraft"), ["a", "b"], [[Candidate(())]] * 2)
    assert not p.should_build(Mode.named("cachecraft"), ["a", "b"])
    p.choose(Mode.named("cachecraft"), ["b", "a"], [[Candidate(())]] * 2)
    assert p.should_build(Mode.named("cachecraft"), ["b", "a"])
    assert (
        not p.should_build(Mode.named("prefix"), ["a", "b"])
        and p.harvests(Mode.named("prefix"))
        and not p.harvests(Mode.named("cacheblend"))
    )
    # never observed: not asked
    assert policy(craft_build_after=0).should_build(Mode.named("cachecraft"), ["z"]) is False
    always = policy(craft_build_after=0)
    always.choose(Mode.named("cachecraft"), ["z"], [[Candidate(())]])
    assert always.should_build(Mode.named("cachecraft"), ["z"])


def test_exact_rows_end_where_the_first_blended_chunk_starts(engine):
    chunks = chunk_inputs(engine)
    result = engine.prefill(chunks, QUESTION, mode=Mode.named("cacheblend"))
    layers = engine.loaded.spec.num_layers
    assert exact_chunks(result, source_contexts(chunks), layers) == [True, False, False, False]
    computed = [dataclasses.replace(c, kv=None) if i == 1 else c for i, c in enumerate(chunks)]
    result = engine.prefill(computed, QUESTION, mode=Mode.named("cacheblend"))
    # a chunk with no cache runs every layer over exact rows: exact; the next one is blended
    assert exact_chunks(result, source_contexts(computed), layers) == [True, True, False, False]


def test_a_build_starts_after_the_exact_leading_chunks(engine):
    book = VariantBook(
        engine,
        policy=VariantPolicy(
            dataclasses.replace(engine.config, craft_build_after=0), engine.loaded.spec.num_layers
        ),
    )
    chunks = chunk_inputs(engine)
    for chunk in chunks:
        book.add(chunk.chunk_id, chunk.kv)
    ids = [c.chunk_id for c in chunks]
    inputs = book.inputs(ids, Mode.named("cachecraft"))
    result = engine.prefill(inputs, QUESTION, mode=Mode.named("cachecraft"))
    assert book.record(result, inputs) == len(ids) - 1
    [work] = book.build_work
    first_start, first_end = result.layout.chunk_spans[0]
    # the system prefix and the exact first chunk came from cache
    assert int(work[:first_end].sum()) == 0
    assert bool((work[first_end:] == engine.loaded.spec.num_layers).all())
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    again = engine.prefill(
        book.inputs(ids, Mode.named("cachecraft")), QUESTION, mode=Mode.named("cachecraft")
    )
    assert again.recomputed_tokens == 0
    torch.testing.assert_close(again.logits, full.logits, rtol=1e-4, atol=1e-4)


def test_inline_builds_compute_a_recurring_set_exactly_and_keep_it(engine):
    config = dataclasses.replace(engine.config, craft_build="inline")
    book = VariantBook(engine, policy=VariantPolicy(config, engine.loaded.spec.num_layers))
    chunks = chunk_inputs(engine)
    for chunk in chunks:
        book.add(chunk.chunk_id, chunk.kv)
    ids = [c.chunk_id for c in chunks]
    strategies = []
    for _ in range(3):
        inputs = book.inputs(ids, Mode.named("cachecraft"))
        result = engine.prefill(inputs, QUESTION, mode=Mode.named("cachecraft"))
        book.record(result, inputs)
        strategies.append([c.strategy for c in result.chunks])
    assert strategies[0][1:] == ["deviation"] * 3  # first sight: blended, nothing kept
    assert strategies[1] == ["reuse"] + ["computed"] * 3  # it recurs: computed in context, kept
    assert strategies[2] == ["reuse"] * 4 and not book.build_work  # no second prefill ever ran
    full = engine.prefill(chunks, QUESTION, mode=Mode.named("full"))
    torch.testing.assert_close(result.logits, full.logits, rtol=1e-4, atol=1e-4)
    assert not policy(craft_build="inline").should_build(Mode.named("cachecraft"), ids)
    with pytest.raises(ValueError, match="craft_build"):
        EngineConfig(craft_build="later")
