"""Prompt layout: segments, spans and the chat format around the passages."""

from __future__ import annotations

import pytest

from engine import InvalidRequest
from engine.prompt import PromptBuilder


@pytest.fixture(scope="module")
def builder(smol_tokenizer):
    return PromptBuilder(smol_tokenizer, "Be helpful.", "Read the passages.")


def test_layout_spans_and_segments_cover_the_sequence(builder):
    chunks = [builder.chunk_ids("First passage."), builder.chunk_ids("Second one.", "Title")]
    layout = builder.layout(chunks, "What is first?")
    (a0, a1), (b0, b1) = layout.chunk_spans
    assert a0 == layout.prefix_len and a1 == b0 and b1 == layout.question_span[0]
    assert layout.total_len == len(layout.token_tensor())
    seg = layout.segment_ids()
    assert seg[:a0].eq(-1).all() and seg[a0:a1].eq(0).all() and seg[b0:b1].eq(1).all()
    assert seg[layout.question_span[0] :].eq(2).all()


def test_prefix_and_suffix_follow_the_chat_template(builder, smol_tokenizer):
    layout = builder.layout([builder.chunk_ids("Passage.")], "Why?")
    text = smol_tokenizer.decode(layout.token_tensor())
    assert text.startswith(
        "<|im_start|>system\nBe helpful.<|im_end|>\n<|im_start|>user\nRead the passages."
    )
    assert text.endswith("Question: Why?<|im_end|>\n<|im_start|>assistant\n")


def test_chunks_are_tokenized_alone(builder, smol_tokenizer):
    ids = builder.chunk_ids("Alpha beta.", "T")
    assert smol_tokenizer.decode(ids) == "T\n\nAlpha beta.\n\n"


def test_empty_chunk_is_refused(builder):
    with pytest.raises(InvalidRequest, match="empty"):
        builder.layout([()], "Q?")
