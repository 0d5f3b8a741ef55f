"""The chunker packs whole sentences up to the token budget, overlaps, and loses no text."""

from __future__ import annotations

import re

import pytest

from retrieval.chunker import Chunker


def words(text: str) -> int:
    return len(text.split())


TEXT = " ".join(f"Sentence number {i} has exactly seven words." for i in range(40))


def test_blank_text_gives_no_chunks():
    assert Chunker(words, 32, 4).split("  \n\n  ") == []


def test_short_text_is_one_chunk():
    chunks = Chunker(words, 64, 8).split("One sentence. Two sentences!")
    assert [c.text for c in chunks] == ["One sentence. Two sentences!"]
    assert chunks[0].num_tokens == 4


def test_chunks_respect_the_budget_and_end_at_sentences():
    chunks = Chunker(words, 30, 0).split(TEXT)
    assert len(chunks) == 10  # four seven-word sentences fit in 30 tokens
    for chunk in chunks:
        assert chunk.num_tokens <= 30
        assert chunk.text.endswith("words.") and chunk.text.startswith("Sentence")
        assert TEXT[chunk.start : chunk.end] == chunk.text


def test_chunks_cover_the_text_in_order():
    chunks = Chunker(words, 30, 0).split(TEXT)
    assert " ".join(c.text for c in chunks) == TEXT


def test_overlap_repeats_trailing_sentences():
    chunks = Chunker(words, 30, 10).split(TEXT)
    for before, after in zip(chunks, chunks[1:]):
        last_sentence = re.findall(r"Sentence number \d+", before.text)[-1]
        assert after.text.startswith(last_sentence)
        assert after.start < before.end


def test_paragraph_breaks_are_boundaries():
    text = "# Heading without a full stop\n\nBody text here. More body."
    chunks = Chunker(words, 8, 0).split(text)
    assert chunks[0].text == "# Heading without a full stop"


def test_a_sentence_longer_than_a_chunk_is_cut_at_words():
    text = " ".join(f"w{i}" for i in range(100)) + "."
    chunks = Chunker(words, 16, 0).split(text)
    assert all(c.num_tokens <= 16 for c in chunks)
    assert " ".join(c.text for c in chunks) == text


def test_closing_quotes_stay_with_their_sentence():
    chunks = Chunker(words, 8, 0).split(
        'He said "stop here now." Then he left at once, in a hurry.'
    )
    assert chunks[0].text == 'He said "stop here now."'


def test_real_tokenizer_budget_holds(smol_tokenizer):
    def count(text):
        return len(smol_tokenizer.encode(text, add_special_tokens=False))

    chunks = Chunker(count, 48, 8).split(TEXT * 2)
    assert len(chunks) > 5
    assert all(count(c.text) == c.num_tokens <= 48 for c in chunks)


@pytest.mark.parametrize("size,overlap", [(4, 0), (64, 32), (64, -1)])
def test_bad_settings_are_refused(size, overlap):
    with pytest.raises(ValueError):
        Chunker(words, size, overlap)
