"""`text_problem`: the one check of text bound for the tokenizer, the embedder and the catalog."""

from __future__ import annotations

import pytest

from retrieval.text import text_problem


@pytest.mark.parametrize("text", ["plain", "tab\tnew\nline\r", "form\x0cfeed", "emoji 🙂", "中文"])
def test_encodable_text_passes(text):
    assert text_problem(text) is None


@pytest.mark.parametrize(
    "text,needle",
    [("cut \ud83d", "U+D83D at character 4"), ("\ude00", "surrogate"), ("a\x00b", "NUL")],
)
def test_unencodable_text_is_named(text, needle):
    problem = text_problem(text)
    assert problem is not None and needle in problem
    with pytest.raises(UnicodeEncodeError):  # what the fast tokenizers trip over
        "\ud83d".encode()
