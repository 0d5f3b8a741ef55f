"""A request's decode: a stream of text pieces, then the immutable record of what it did.

`Engine.generate` returns a `Decoding`: iterate it for the answer's text pieces (closing it
early cancels the request); once it has ended, `decoded()` returns a `Decoded`: the token ids,
the cache the answer was decoded in and the guard's final report, with the `Repair` when the
balanced guard stopped the blended decode and went on from an exact prefill of the prompt and
the answer so far. The prefill's `PrefillResult` is never changed: a repair is a record beside it.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequest
from engine.kv import KVCache
from engine.model.decode import TextStream
from engine.result import PrefillResult
from engine.serving.guard import GuardReport
from engine.serving.repair import AnswerIds, Repair

if TYPE_CHECKING:  # transformers is imported only when a model is loaded
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Decoded:
    """What one decode did: the answer's token ids, the cache they were decoded in (the
    prefill's, or the repair's exact one), and the guard's report for the whole request."""

    token_ids: tuple[int, ...]
    cache: KVCache
    guard: GuardReport
    repair: Repair | None = None

    @property
    def repaired(self) -> bool:
        """Every prompt row of `cache` is the reference's (the guard repaired the decode)."""
        return self.repair is not None


class Decoding:
    """The text pieces of one answer (an iterator); `close` cancels the decode. The answer's
    stream is read on the caller's thread; the guard's `Repair` that it carries is kept for
    `decoded`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, ids: AnswerIds, result: PrefillResult):
        self._token_ids: list[int] = []
        self._repair: Repair | None = None
        self._pieces = TextStream(tokenizer, self._kept(ids), collected=self._token_ids)
        self._result = result
        self._ended = False

    def _kept(self, ids: AnswerIds) -> Generator[int, None, None]:
        """The token ids of `ids`, keeping its repair (closing this closes `ids`)."""
        with closing(ids):
            for item in ids:
                if isinstance(item, Repair):
                    self._repair = item
                else:
                    yield item

    def __iter__(self) -> Decoding:
        return self

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except StopIteration:
            self._ended = True
            raise

    def close(self) -> None:
        self._pieces.close()
        self._ended = True

    @property
    def num_tokens(self) -> int:
        """Answer tokens so far."""
        return len(self._token_ids)

    def decoded(self) -> Decoded:
        """The record of the decode; InvalidRequest while it is still under way."""
        if not self._ended:
            raise InvalidRequest("the decode is still under way: read or close it first")
        repair = self._repair
        guard = self._result.guard
        if repair is not None:
            guard = guard.repaired(
                repair.at, repair.margin, repair.seconds, repair.reason, repair.span
            )
        cache = repair.cache if repair is not None else self._result.cache
        return Decoded(tuple(self._token_ids), cache, guard, repair)


def read_out(decoding: Decoding) -> tuple[str, Decoded]:
    """The whole answer of `decoding` as text, and its record (for callers that do not stream)."""
    with closing(decoding):
        text = "".join(decoding)
    return text, decoding.decoded()
