"""APE's attention knobs on the Hugging Face path: plain attention at T = S = 1, the
contexts' share scaled by S."""

from __future__ import annotations

import pytest
import torch

from bench.fidelity.adapt import distiller_of
from bench.fidelity.ape import Knobs, reading_with, use_ape
from engine.adapt.packets import logits_after, prefix_rows, reused_cache
from tests.engine.helpers import PASSAGES, QUESTION, engine_with_packets


@pytest.fixture(scope="module")
def reading(smol_tokenizer, tmp_path_factory):
    """The tiny model on APE's attention, three chunks reused, the question's ids."""
    engine = engine_with_packets(smol_tokenizer, tmp_path_factory.mktemp("ape"), None)
    distiller = distiller_of(engine)
    use_ape(distiller.model)
    chunks = [engine.chunk_ids(text, title) for title, text in PASSAGES[:3]]
    return engine, distiller, chunks, engine.prompts.question_ids(QUESTION)


def question_logits(distiller, chunks, question, knobs=None):
    with torch.no_grad():
        cache, position = reused_cache(
            distiller.model, distiller.prefix, chunks, None, distiller.inv_freq
        )
        if knobs is None:
            return logits_after(distiller.model, cache, position, question)
        with reading_with(knobs, distiller.start, position):
            return logits_after(distiller.model, cache, position, question)


def test_temperature_and_scale_one_read_as_plain_attention(reading):
    _, distiller, chunks, question = reading
    plain = question_logits(distiller, chunks, question)
    torch.testing.assert_close(
        question_logits(distiller, chunks, question, Knobs(1.0, 1.0)), plain, rtol=1e-4, atol=1e-4
    )
    assert not torch.allclose(
        question_logits(distiller, chunks, question, Knobs(0.9, 0.9)), plain, atol=1e-3
    )


def test_a_vanishing_scale_reads_as_if_the_contexts_were_not_there(reading):
    engine, distiller, chunks, question = reading
    position = distiller.start + sum(len(c) for c in chunks)
    with torch.no_grad():  # the prefix alone, the question at the same positions
        cache = reused_cache(distiller.model, distiller.prefix, [], None, distiller.inv_freq)[0]
        alone = logits_after(distiller.model, cache, position, question)
    faded = question_logits(distiller, chunks, question, Knobs(1.0, 1e-12))
    torch.testing.assert_close(faded, alone, rtol=1e-3, atol=1e-3)


def test_knobs_parse_and_refuse_what_is_not_positive():
    assert Knobs.parse("0.9:0.8") == Knobs(0.9, 0.8) and Knobs.parse("0.7") == Knobs(0.7, 0.7)
    assert Knobs(0.9, 0.8).label == "ape[T=0.9;S=0.8]"
    with pytest.raises(ValueError, match="positive"):
        Knobs(0.0, 1.0)


def test_outside_reading_the_model_attends_as_before(reading):
    engine, distiller, chunks, _ = reading
    prefix = prefix_rows(distiller.model, engine.prompts.prefix_ids)
    for (k, v), (k0, v0) in zip(prefix, distiller.prefix):
        torch.testing.assert_close(k, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v0, rtol=1e-5, atol=1e-5)
