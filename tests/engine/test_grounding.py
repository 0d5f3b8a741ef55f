"""The grounding check (engine/serving/grounding.py): which spans of an answer are candidates,
which its sources ground, and what the stream holds back; on the tiny model, a span no passage
contains stops the blended decode before any of its tokens is sent."""

from __future__ import annotations

import dataclasses

import pytest

from engine import EngineConfig
from engine.decoding import Repair
from engine.engine import Engine
from engine.model.decode import SamplingParams
from engine.planners import Mode
from engine.serving.grounding import AnswerGrounding, Sources, candidate_spans, held_from
from engine.serving.guarded import GuardedRequest
from tests.engine.helpers import QUESTION, chunk_inputs

SOURCE = Sources(
    "The Hollin Point Lighthouse was first lit on 3 November 1811 by its keeper, Ada Marsh. "
    "It stands 35.5 metres tall and cost £1,200. Zürich sent its lens in May 1812. "
    "When was the Hollin Point Lighthouse first lit?"
)


def spans(text: str) -> list[tuple[str, str, bool]]:
    return [(s.text, s.kind, SOURCE.contains(s)) for s in candidate_spans(text)]


def test_a_date_is_grounded_as_one_unit():
    assert spans("It was first lit on 1 November 1811.") == [("1 November 1811", "date", False)]
    assert spans("On 3 November 1811.") == [("3 November 1811", "date", True)]
    assert spans("Lit on November 3rd, 1811") == [("November 3rd, 1811", "date", True)]
    assert spans("the 3rd of Nov. 1811") == [("3rd of Nov. 1811", "date", True)]
    assert spans("in November 1811") == [("November 1811", "date", True)]
    assert spans("in May 1811") == [("May 1811", "date", False)]
    assert spans("on 3 November") == [("3 November", "date", True)]


def test_numbers_are_compared_whole():
    assert spans("It was lit in 1811 and 1769.") == [
        ("1811", "number", True),
        ("1769", "number", False),
    ]
    assert spans("about 35.5 metres, not 35 or 11") == [
        ("35.5", "number", True),
        ("35", "number", False),
        ("11", "number", False),
    ]
    assert spans("it cost 1200 pounds") == [("1200", "number", True)]  # "£1,200" in the source


def test_names_are_runs_of_capitalised_words_past_a_sentence_start():
    assert spans("Hollin Point was lit by Ada Marsh.") == [
        ("Point", "name", True),  # the first word is capitalised by position
        ("Ada Marsh", "name", True),
    ]
    assert spans("It was lit by John Marsh.") == [("John Marsh", "name", False)]
    assert spans("The keeper. Ada lit it, not I.") == []  # sentence starts, one letter
    assert spans("the lens came from zürich, from Zürich") == [("Zürich", "name", True)]
    assert spans("the lens came from ZÜRICH") == [("ZÜRICH", "name", True)]  # case-folded
    assert spans("the keeper’s lamp, Ada’s") == [
        ("Ada's", "name", False)
    ]  # apostrophes straightened


@pytest.mark.parametrize(
    "text,held",
    [
        ("It was lit in 18", "It was lit in "),  # inside a number
        ("lit on 3 Nov", "lit on "),  # a date still growing
        ("lit on 3 November 1811. It", "lit on "),  # one word after a span: may still grow
        ("lit on 3 November 1811. It was", "lit on 3 November 1811. It was"),
        ("lit by Ada", "lit by "),
        ("lit by Ada Marsh and", "lit by "),
        ("lit by Ada Marsh and the", "lit by Ada Marsh and the"),
        ("lit by Z\ufffd", "lit by "),  # an incomplete character inside a name
        ("it was lit \ufffd", "it was lit "),
    ],
)
def test_the_stream_holds_back_from_an_unfinished_span(text, held):
    assert text[: held_from(text, candidate_spans(text))] == held


def test_tokens_are_released_up_to_an_unfinished_span_and_stopped_before_an_ungrounded_one(
    smol_tokenizer,
):
    ids = smol_tokenizer.encode("It was first lit on 1 November 1811 by the keeper, and so on.")
    grounding = AnswerGrounding(smol_tokenizer, SOURCE)
    released: list[int] = []
    for token in ids:
        release = grounding.push(token)
        released.extend(release.tokens)
        if release.ungrounded is not None:
            break
    assert release.ungrounded is not None and release.ungrounded.text == "1 November 1811"
    assert smol_tokenizer.decode(released) == "It was first lit on "
    assert grounding.released == len(released)


def test_a_span_held_at_the_answers_end_is_checked_and_released(smol_tokenizer):
    for answer, ungrounded in (("It was lit in 1811", None), ("It was lit in 1769", "1769")):
        grounding = AnswerGrounding(smol_tokenizer, SOURCE)
        released = [
            t for token in smol_tokenizer.encode(answer) for t in grounding.push(token).tokens
        ]
        assert smol_tokenizer.decode(released) == "It was lit in "
        end = grounding.end()
        assert (end.ungrounded.text if end.ungrounded else None) == ungrounded
        if ungrounded is None:
            assert smol_tokenizer.decode(released + list(end.tokens)) == answer


def watched_engine(tiny_engine, grounding: bool) -> Engine:
    """A tiny engine whose balanced blends are watched for grounding only (margins never fire)."""
    config = EngineConfig(
        data_dir=tiny_engine.config.data_dir,
        guard_margin=0.0,
        guard_answer_margin=0.0,
        reuse_profile="off",
        batching=False,
        epic_tokens=4,
        guard_grounding=grounding,
    )
    return Engine(config, tiny_engine.model_loaded)


# the tiny model's seeded sample names a capitalised word that no passage holds
SAMPLE = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)


def streamed(engine: Engine, chunks) -> list[int | Repair]:
    result = engine.prefill(chunks, QUESTION, Mode.named("cacheblend"), max_new_tokens=24)
    return list(GuardedRequest(engine).answer(result, SAMPLE, None))


def test_an_ungrounded_span_is_repaired_before_its_tokens_are_sent(tiny_engine, smol_tokenizer):
    chunks = chunk_inputs(tiny_engine)
    blended = streamed(watched_engine(tiny_engine, grounding=False), chunks)
    guarded = streamed(watched_engine(tiny_engine, grounding=True), chunks)
    assert not any(isinstance(item, Repair) for item in blended)
    repairs = [i for i, item in enumerate(guarded) if isinstance(item, Repair)]
    assert len(repairs) == 1  # at most one repair
    at = repairs[0]
    repair = guarded[at]
    assert isinstance(repair, Repair) and repair.reason == "grounding" and repair.at == at
    assert repair.margin is None and repair.span
    # what went out before the repair is the blend's answer up to the span, without it
    assert guarded[:at] == blended[:at]
    before = smol_tokenizer.decode(blended[:at])
    assert repair.span not in before
    assert repair.span in smol_tokenizer.decode(blended)[len(before) :].lstrip()[: len(repair.span)]
    # the report names it
    engine = watched_engine(tiny_engine, grounding=True)
    result = engine.prefill(chunks, QUESTION, Mode.named("cacheblend"), max_new_tokens=24)
    stream = engine.generate(result, SAMPLE)
    "".join(stream)
    guard = stream.decoded().guard
    assert guard.repaired_at == at and guard.repair_reason == "grounding"
    assert guard.repair_span == repair.span and guard.outcome == "repaired"
    assert f"{repair.span!r} is in no passage" in guard.estimate


def test_a_seeded_sample_repaired_for_grounding_is_repeatable(tiny_engine):
    chunks = chunk_inputs(tiny_engine)
    engine = watched_engine(tiny_engine, grounding=True)
    first, second = streamed(engine, chunks), streamed(engine, chunks)
    ints = [[t for t in run if isinstance(t, int)] for run in (first, second)]
    assert ints[0] == ints[1]


def test_a_margin_repair_starts_at_a_span_still_held(tiny_engine):
    config = dataclasses.replace(
        watched_engine(tiny_engine, grounding=True).config, guard_answer_margin=1e9
    )
    engine = Engine(config, tiny_engine.model_loaded)  # the margin fires at the first watched step
    streamed_items = streamed(engine, chunk_inputs(tiny_engine))
    repair = streamed_items[0]  # the sample's first word was held back: nothing went out
    assert isinstance(repair, Repair) and repair.at == 0 and repair.reason == "margin"
    assert repair.margin is not None and repair.span == "Hawaiian"
