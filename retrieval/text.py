"""Which texts the tokenizer and the embedder can encode: the one check every text passes
before it reaches them (a question, a chat message, a document and its title).

A lone surrogate (a cut-off emoji sent as a JSON escape) cannot become UTF-8, so the fast
tokenizers refuse it with a TypeError deep inside a request; NUL is not text, and PostgreSQL
cannot store it in the catalog. Other control characters (a form feed in a document) encode
and are kept. This module only says what is wrong; the caller turns it into its refusal.
"""

from __future__ import annotations

import re

# NUL and the surrogate range
_UNENCODABLE = re.compile("[\x00\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """Why `text` cannot be encoded, naming the first offending character by code point and
    index (`a lone surrogate U+D83D at character ...`); None when it can."""
    found = _UNENCODABLE.search(text)
    if found is None:
        return None
    char = found.group()
    where = f"U+{ord(char):04X} at character {found.start()}"
    if "\ud800" <= char <= "\udfff":
        return f"a lone surrogate {where} (a cut-off emoji?); send valid Unicode"
    return f"a NUL character ({where}); send plain text"
