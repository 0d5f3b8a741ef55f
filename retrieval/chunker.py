"""Token-aware chunking: pack whole sentences into chunks of at most `chunk_tokens` tokens.

Chunks are cut at sentence (or paragraph) boundaries; a sentence longer than a whole chunk
is cut at word boundaries instead. Consecutive chunks share up to `overlap_tokens` tokens of
trailing sentences, so a fact that straddles a cut is still whole in one of them.
Token counts come from the caller's `count_tokens` (the LLM's tokenizer in the server), so
a chunk's size is what it will cost in the prompt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# A sentence ends at . ! ? (optionally followed by closing quotes/brackets) before whitespace,
# or at a blank line (paragraphs, headings, list items without final punctuation).
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n")


@dataclass(frozen=True)
class TextChunk:
    """One chunk: its text, its place in the document ([start, end) characters) and its size."""

    text: str
    start: int
    end: int
    num_tokens: int


@dataclass(frozen=True)
class _Piece:
    start: int
    end: int
    tokens: int


class Chunker:
    """Splits text into chunks of at most `chunk_tokens` tokens, overlapping by `overlap_tokens`."""

    def __init__(
        self, count_tokens: Callable[[str], int], chunk_tokens: int = 384, overlap_tokens: int = 48
    ):
        if chunk_tokens < 8:
            raise ValueError("chunk_tokens must be at least 8")
        if not 0 <= overlap_tokens < chunk_tokens // 2:
            raise ValueError("overlap_tokens must lie in [0, chunk_tokens / 2)")
        self.count_tokens = count_tokens
        self.chunk_tokens = chunk_tokens
        self.overlap_tokens = overlap_tokens

    def split(self, text: str) -> list[TextChunk]:
        """Chunks in document order; empty or blank text gives no chunks."""
        pieces = [p for span in _sentence_spans(text) for p in self._fit(text, *span)]
        chunks: list[TextChunk] = []
        first = 0
        while first < len(pieces):
            last = self._pack(text, pieces, first)
            start, end = pieces[first].start, pieces[last].end
            chunks.append(
                TextChunk(text[start:end], start, end, self.count_tokens(text[start:end]))
            )
            if last == len(pieces) - 1:
                break
            first = self._overlap_start(pieces, first, last)
        return chunks

    def _pack(self, text: str, pieces: list[_Piece], first: int) -> int:
        """Index of the last piece of the chunk that starts at `first` (always >= first)."""
        last, total = first, pieces[first].tokens
        while last + 1 < len(pieces) and total + pieces[last + 1].tokens <= self.chunk_tokens:
            last += 1
            total += pieces[last].tokens
        # Summed counts approximate the joined text's count; trust only the real count.
        while (
            last > first
            and self.count_tokens(text[pieces[first].start : pieces[last].end]) > self.chunk_tokens
        ):
            last -= 1
        return last

    def _overlap_start(self, pieces: list[_Piece], first: int, last: int) -> int:
        """First piece of the next chunk: reuse trailing pieces worth <= overlap_tokens."""
        start, carried = last + 1, 0
        while start - 1 > first and carried + pieces[start - 1].tokens <= self.overlap_tokens:
            start -= 1
            carried += pieces[start].tokens
        return start

    def _fit(self, text: str, start: int, end: int) -> list[_Piece]:
        """One sentence as pieces that each fit a chunk (cut at words if it is too long)."""
        tokens = self.count_tokens(text[start:end])
        if tokens <= self.chunk_tokens:
            return [_Piece(start, end, tokens)]
        pieces, piece_start, piece_end = [], start, start
        for word in re.finditer(r"\S+", text[start:end]):
            word_end = start + word.end()
            if (
                piece_end > piece_start
                and self.count_tokens(text[piece_start:word_end]) > self.chunk_tokens
            ):
                pieces.append(
                    _Piece(piece_start, piece_end, self.count_tokens(text[piece_start:piece_end]))
                )
                piece_start = start + word.start()
            piece_end = word_end
        pieces.append(
            _Piece(piece_start, piece_end, self.count_tokens(text[piece_start:piece_end]))
        )
        return pieces


def _sentence_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of every non-blank sentence, trimmed of surrounding whitespace."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        spans.append((start, match.end()))  # trimming drops the whitespace, keeps closing quotes
        start = match.end()
    spans.append((start, len(text)))
    return [trimmed for span in spans if (trimmed := _trim(text, *span))]


def _trim(text: str, start: int, end: int) -> tuple[int, int] | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if end > start else None
