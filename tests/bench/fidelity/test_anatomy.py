"""The anatomy bench's instruments: hybrid caches and recompute masks reproduce their extremes."""

import math
from types import SimpleNamespace

import pytest
import torch

from bench.fidelity import anatomy as anatomy_module
from bench.fidelity.anatomy import Anatomy, hybrids

RECORD = {
    "question": "What colour is the door of Hollin Point?",
    "answers": ["green"],
    "ctxs": [
        {"title": "Marsh Road", "text": "Marsh Road runs past the old mill to the river."},
        {"title": "Hollin Point", "text": "The lighthouse at Hollin Point has a green door."},
        {"title": "Kettle Bay", "text": "Kettle Bay has a harbour wall of grey stone."},
    ],
}


@pytest.fixture
def kept_case(tiny_engine, monkeypatch):
    # a random model answers nothing right: keep the record whatever full prefill says
    monkeypatch.setattr(
        anatomy_module, "score_answer", lambda answer, golds: SimpleNamespace(contains=True)
    )
    anatomy = Anatomy(tiny_engine, probe_layer=2)
    case = anatomy.case(RECORD, 0)
    assert case is not None and case.answer == 1
    return anatomy, case


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-4)


def test_a_hybrid_from_all_of_full_is_full_and_from_none_is_naive(kept_case):
    anatomy, case = kept_case
    layers = anatomy.layers
    lens = [end - start for start, end in case.full.layout.chunk_spans]
    every = [torch.ones(n, dtype=torch.bool) for n in lens]
    assert close(
        anatomy.hybrid(case, torch.ones(layers, dtype=torch.bool), every).logits, case.full.logits
    )
    assert close(
        anatomy.hybrid(case, torch.zeros(layers, dtype=torch.bool), every).logits, case.naive.logits
    )
    assert not close(case.full.logits, case.naive.logits)  # else the two checks above prove nothing


def test_recomputing_every_context_row_is_full_and_none_is_naive(kept_case):
    anatomy, case = kept_case
    context = case.request.context_mask()
    assert close(anatomy.recompute(case, context).logits, case.full.logits)
    assert close(anatomy.recompute(case, torch.zeros_like(context)).logits, case.naive.logits)


def test_focus_masks_pick_whole_chunks_or_the_asked_share_of_context_rows(kept_case):
    anatomy, case = kept_case
    context = case.request.context_mask()
    masks = anatomy.focus_rows(case)
    spans = case.request.layout.chunk_spans
    for name, mask in masks.items():
        assert not (mask & ~context).any(), name
    top = masks["focus: top chunk"]
    assert [int(top[a:b].sum()) for a, b in spans].count(0) == len(spans) - 1
    assert any(bool(top[a:b].all()) for a, b in spans)
    assert int(masks["focus: top rows 0.20"].sum()) == math.ceil(0.2 * int(context.sum()))
    oracle = masks["oracle: the answer's chunk"]
    a, b = spans[case.answer]
    assert bool(oracle[a:b].all()) and int(oracle.sum()) == b - a
    assert anatomy.rows["probe's top chunk is the answer's"] == [(bool(top[a:b].all()), 0.0)]


def test_the_hybrid_rows_cover_the_answer_chunk_its_neighbours_and_each_layer_quarter(kept_case):
    anatomy, case = kept_case
    rows = hybrids(case, anatomy.layers)
    layers, tokens = rows["exact: the answer's chunk"]
    assert bool(layers.all()) and [bool(t.all()) for t in tokens] == [False, True, False]
    layers, tokens = rows["exact: chunks before the answer's"]
    assert [bool(t.all()) for t in tokens] == [True, False, False]
    quarters = [rows[name][0] for name in rows if name.endswith("only")]
    assert len(quarters) == 4 and bool(torch.stack(quarters).sum(0).eq(1).all())


def test_records_that_do_not_name_one_passage_are_left_out(tiny_engine):
    unnamed = dict(RECORD, question="What colour is the door?")
    assert Anatomy(tiny_engine, probe_layer=2).case(unnamed, 0) is None
