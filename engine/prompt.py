"""Prompt layout: [system prefix][chunk 1]...[chunk k][question suffix], as token ids.

Every mode runs on the same token sequence: each chunk is tokenized alone and the pieces are
concatenated, and `full` prefills exactly that sequence. The prefix and suffix come from the
model's own chat template, rendered once with a marker where the passages go and split there.
`PromptBuilder.boundaries` says whether the pieces tokenized alone give the same ids as the
whole text tokenized at once, and at which boundary they first differ.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, cast

import torch

from engine.errors import InvalidRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What precedes every chunk and the question in the prompt's text: the instruction and each
# chunk end with a blank line (`_split_template`, `_chunk_text`).
_PIECE_ANCHOR = "\n\n"
_CONTEXT_MARK = "\u2063KVMOSAIC_CONTEXT\u2063"
_QUESTION_MARK = "\u2063KVMOSAIC_QUESTION\u2063"


@dataclass(frozen=True)
class PromptLayout:
    """Token ids of one prompt, by segment, and where each segment sits."""

    prefix_ids: tuple[int, ...]
    chunk_ids: tuple[tuple[int, ...], ...]
    question_ids: tuple[int, ...]

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    @cached_property
    def chunk_spans(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of every chunk in the full sequence."""
        spans, start = [], self.prefix_len
        for ids in self.chunk_ids:
            spans.append((start, start + len(ids)))
            start += len(ids)
        return tuple(spans)

    @property
    def question_span(self) -> tuple[int, int]:
        start = self.chunk_spans[-1][1] if self.chunk_ids else self.prefix_len
        return start, start + len(self.question_ids)

    @property
    def total_len(self) -> int:
        return self.question_span[1]

    @property
    def num_context_tokens(self) -> int:
        return sum(len(ids) for ids in self.chunk_ids)

    def token_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """All ids as one LongTensor [total_len]."""
        flat = list(self.prefix_ids)
        for ids in self.chunk_ids:
            flat.extend(ids)
        flat.extend(self.question_ids)
        return torch.tensor(flat, dtype=torch.long, device=device)

    def segment_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Per position: -1 prefix, i for chunk i, len(chunks) for the question. [total_len]"""
        seg = torch.full((self.total_len,), -1, dtype=torch.long, device=device)
        for i, (start, end) in enumerate(self.chunk_spans):
            seg[start:end] = i
        qs, qe = self.question_span
        seg[qs:qe] = len(self.chunk_ids)
        return seg


@dataclass(frozen=True)
class BoundaryCheck:
    """Pieces tokenized alone against the whole prompt text tokenized at once.

    ok: the ids are identical. Otherwise `boundary` names where they first differ (e.g.
    "system prefix | chunk 1") and `alone` / `together` hold a few tokens from there on.
    """

    ok: bool
    boundary: str = ""
    alone: tuple[str, ...] = ()
    together: tuple[str, ...] = ()


class PromptBuilder:
    """Turns (chunk texts, question) into a PromptLayout with the model's chat format."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str, instruction: str):
        self.tokenizer = tokenizer
        prefix_text, suffix_text = _split_template(tokenizer, system_prompt, instruction)
        self.prefix_text = prefix_text
        self._anchor_ids = self._encode(_PIECE_ANCHOR)
        self.prefix_ids = tuple(self._encode(prefix_text))
        self._suffix_before, self._suffix_after = suffix_text.split(_QUESTION_MARK)
        self.prefix_digest = hashlib.sha256(repr(self.prefix_ids).encode()).hexdigest()[:16]

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    def chunk_ids(self, text: str, title: str = "") -> tuple[int, ...]:
        """A chunk's ids, tokenized alone: "title\\n\\ntext\\n\\n" (title optional)."""
        return tuple(self._encode_piece(_chunk_text(text, title)))

    def question_ids(self, question: str) -> tuple[int, ...]:
        return tuple(self._encode_piece(self._question_text(question)))

    def boundaries(self, chunks: list[tuple[str, str]], question: str) -> BoundaryCheck:
        """Tokenize [prefix][chunks (title, text)...][question] piece by piece and as one text.

        Every mode runs on the pieces' ids; this says whether they are also the ids of the
        prompt's text, the sequence the model saw in training (and names the first boundary
        where they are not).
        """
        texts = [
            self.prefix_text,
            *(_chunk_text(text, title) for title, text in chunks),
            self._question_text(question),
        ]
        names = ["system prefix", *(f"chunk {i + 1}" for i in range(len(chunks))), "question"]
        pieces = [list(self.prefix_ids), *(self._encode_piece(text) for text in texts[1:])]
        alone = [t for ids in pieces for t in ids]
        together = self._encode("".join(texts))
        if alone == together:
            return BoundaryCheck(True)
        first = next(
            (i for i, (a, b) in enumerate(zip(alone, together)) if a != b),
            min(len(alone), len(together)),
        )
        tokens = self.tokenizer.convert_ids_to_tokens
        return BoundaryCheck(
            False,
            _boundary_at(first, [len(ids) for ids in pieces], names),
            tuple(tokens(alone[first : first + 3])),
            tuple(tokens(together[first : first + 3])),
        )

    def _question_text(self, question: str) -> str:
        question = question.strip()
        if not question:
            raise InvalidRequest("the question is empty")
        return self._suffix_before + question + self._suffix_after

    def layout(self, chunk_ids: list[tuple[int, ...]], question: str) -> PromptLayout:
        if not chunk_ids:
            raise InvalidRequest("no chunks: a request needs at least one context chunk")
        if any(len(ids) == 0 for ids in chunk_ids):
            raise InvalidRequest("a chunk is empty after tokenization")
        return PromptLayout(
            self.prefix_ids, tuple(tuple(c) for c in chunk_ids), self.question_ids(question)
        )

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _encode_piece(self, text: str) -> list[int]:
        """Ids of a chunk or question piece as they are where it sits: after _PIECE_ANCHOR.

        SentencePiece-style tokenizers (Llama-2, Mistral) prepend "▁" to every text they
        encode, so a piece tokenized alone would start with a space it does not have in the
        prompt; encoding anchor + piece and dropping the anchor's ids avoids that. Where the
        anchor's own ids are not a prefix of that encoding (the anchor tokenizes otherwise
        before the piece, as "\n\n" does with the GPT-2 split) the piece is encoded alone.
        """
        anchor = self._anchor_ids
        ids = self._encode(_PIECE_ANCHOR + text)
        if ids[: len(anchor)] == anchor:
            return ids[len(anchor) :]
        return self._encode(text)


def _chunk_text(text: str, title: str) -> str:
    return f"{title}\n\n{text}\n\n" if title else f"{text}\n\n"


def _boundary_at(index: int, lengths: list[int], names: list[str]) -> str:
    """The boundary next to token `index` of the concatenated pieces: a piece's first token
    differs because of what precedes it, any later one because of what follows the piece."""
    start = 0
    for i, length in enumerate(lengths):
        if index < start + length or i == len(lengths) - 1:
            if index == start and i > 0:
                return f"{names[i - 1]} | {names[i]}"
            return f"{names[i]} | {names[i + 1]}" if i + 1 < len(names) else f"end of {names[i]}"
        start += length
    return f"end of {names[-1]}"


def _split_template(
    tokenizer: PreTrainedTokenizerBase, system_prompt: str, instruction: str
) -> tuple[str, str]:
    """Render the chat template around markers; return (prefix text, suffix text with the
    question mark)."""
    user = f"{instruction}\n\n{_CONTEXT_MARK}Question: {_QUESTION_MARK}"
    if not getattr(tokenizer, "chat_template", None):  # base models: a plain-text format
        bos = getattr(tokenizer, "bos_token", None) or ""
        return f"{bos}{system_prompt}\n\n{instruction}\n\n", f"Question: {_QUESTION_MARK}\nAnswer:"
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]
    try:
        text = _render_chat(tokenizer, messages)
    except Exception:  # templates without a system role (some Mistral ones)
        merged = [{"role": "user", "content": f"{system_prompt}\n\n{user}"}]
        text = _render_chat(tokenizer, merged)
    prefix, suffix = text.split(_CONTEXT_MARK)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and not prefix.startswith(bos) and getattr(tokenizer, "add_bos_token", False):
        prefix = bos + prefix
    return prefix, suffix


def _render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The chat template rendered as text (typed as any of its tokenized forms; tokenize=False
    gives a str).

    enable_thinking=False: templates with a reasoning switch (Qwen3) open the answer directly, as a
    RAG answer of a few words needs; templates without one ignore the variable.
    """
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    return cast(str, text)
