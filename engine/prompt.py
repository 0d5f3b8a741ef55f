"""Prompt layout: [system prefix][chunk 1]...[chunk k][question suffix], as token ids.

Every mode runs on the same token sequence: each chunk is tokenized alone and the pieces are
concatenated, and `full` prefills exactly that sequence. The prefix and suffix come from the
model's own chat template, rendered once with a marker where the passages go and split there.
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


class PromptBuilder:
    """Turns (chunk texts, question) into a PromptLayout with the model's chat format."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str, instruction: str):
        self.tokenizer = tokenizer
        prefix_text, suffix_text = _split_template(tokenizer, system_prompt, instruction)
        self.prefix_ids = tuple(self._encode(prefix_text))
        self._suffix_before, self._suffix_after = suffix_text.split(_QUESTION_MARK)
        self.prefix_digest = hashlib.sha256(repr(self.prefix_ids).encode()).hexdigest()[:16]

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    def chunk_ids(self, text: str, title: str = "") -> tuple[int, ...]:
        """A chunk's ids, tokenized alone: "title\\n\\ntext\\n\\n" (title optional)."""
        body = f"{title}\n\n{text}\n\n" if title else f"{text}\n\n"
        return tuple(self._encode(body))

    def question_ids(self, question: str) -> tuple[int, ...]:
        question = question.strip()
        if not question:
            raise InvalidRequest("the question is empty")
        return tuple(self._encode(self._suffix_before + question + self._suffix_after))

    def layout(self, chunk_ids: list[tuple[int, ...]], question: str) -> PromptLayout:
        if not chunk_ids:
            raise InvalidRequest("no chunks: a request needs at least one context chunk")
        if any(len(ids) == 0 for ids in chunk_ids):
            raise InvalidRequest("a chunk is empty after tokenization")
        return PromptLayout(self.prefix_ids, tuple(tuple(c) for c in chunk_ids), self.question_ids(question))

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids


def _split_template(tokenizer: PreTrainedTokenizerBase, system_prompt: str, instruction: str) -> tuple[str, str]:
    """Render the chat template around markers; return (prefix text, suffix text with question mark)."""
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
    """The chat template rendered as text (typed as any of its tokenized forms; tokenize=False gives a str)."""
    return cast(str, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
