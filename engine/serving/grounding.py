"""The grounding check: numbers, dates and names of an answer that its sources do not contain.

A blended state that goes wrong with confidence passes the margin checks of guard.py: it says
"1 November 1811" where the passage says 3 November, or moves a year's leading digits. Most
such errors put into the answer a number, date or name that no retrieved passage nor the
question contains, and that the retrieval makes checkable. `AnswerGrounding` reads the
answer token by token and decides which tokens may be sent: a candidate span still growing
(the answer ends inside a number, a date or a capitalised name, or one word after it) is held
back; a settled span is looked up in the sources (`Sources.contains`); the first one they do
not contain is returned, so the guard stops the blended decode before any of its tokens is sent.

Candidates (`candidate_spans`): dates as one unit (day, month and year must appear together in
a source date, whatever its order or spelling: "1 November 1811" is not grounded by a source
that says "3 November 1811", though "1" and "1811" each appear), numbers (digit runs with
their decimals or thousands separators, compared whole), and runs of capitalised words (a run
is compared as a sequence of words, case-insensitively; a sentence's first word is not
counted, being capitalised by position).

What it cannot see: a wrong number or name that is in the sources (a neighbouring passage's
year, a person named in another passage), words that are not candidates (number words such as
"three", lower-case nouns, a sentence's first word alone), units and relations ("35 degrees"
for 35 metres), and anything in an answer the model writes in another script than its
sources. It changes nothing for grounded answers but their streaming (a held span arrives a
word later). It computes no model work; the guard decides what a stop costs (guarded.py).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
_MONTH = r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"  # noqa: E501
_DAY = r"\d{1,2}(?:st|nd|rd|th)?"
_YEAR = r"\d{4}"
_DATE = re.compile(
    rf"\b(?:(?P<d1>{_DAY})\s+(?:of\s+)?(?P<m1>{_MONTH})(?:,?\s+(?P<y1>{_YEAR}))?"
    rf"|(?P<m2>{_MONTH})\s+(?P<d2>{_DAY})(?:,?\s+(?P<y2>{_YEAR}))?(?!\d)"
    rf"|(?P<m3>{_MONTH})\s+(?P<y3>{_YEAR}))\b",
    re.IGNORECASE,
)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[^\W\d_][\w'\-]*")
# after a span: separators and at most one word that the answer's end may still be writing
_OPEN_AFTER = re.compile(r"[\s,.]*[\w'\-]*")
_TAIL_WORD = re.compile(r"[^\W\d_][\w'\-]*$")
_SENTENCE_END = re.compile(r"[.!?:;\n]\s*$")


@dataclass(frozen=True)
class Span:
    """A candidate of the answer's text: [start, end) characters, `kind` "date", "number" or
    "name", and for a date its (day, month, year) with None for a part it does not name."""

    start: int
    end: int
    text: str
    kind: str
    date: tuple[int | None, int | None, int | None] | None = None


def normalized(text: str) -> str:
    """NFKC, case-folded, curly apostrophes straightened: how answers and sources compare."""
    return unicodedata.normalize("NFKC", text).casefold().replace("\u2019", "'")


def candidate_spans(text: str) -> list[Span]:
    """The dates, numbers and names of `text`, in order, none overlapping; offsets are
    `text`'s (only curly apostrophes are straightened first, which keeps them)."""
    folded = text.replace("\u2019", "'")
    spans = [_date_span(m) for m in _DATE.finditer(folded)]
    taken = [(s.start, s.end) for s in spans]
    for m in _NUMBER.finditer(folded):
        if not _overlaps(m.start(), m.end(), taken):
            spans.append(Span(m.start(), m.end(), m.group(), "number"))
    taken = [(s.start, s.end) for s in spans]
    spans.extend(_name_spans(folded, taken))
    return sorted(spans, key=lambda s: s.start)


def _date_span(m: re.Match[str]) -> Span:
    day = m.group("d1") or m.group("d2")
    month = m.group("m1") or m.group("m2") or m.group("m3")
    year = m.group("y1") or m.group("y2") or m.group("y3")
    key = (
        int(re.sub(r"\D", "", day)) if day else None,
        _month_number(month),
        int(year) if year else None,
    )
    return Span(m.start(), m.end(), m.group(), "date", key)


def _month_number(name: str) -> int:
    stem = name.casefold().rstrip(".")[:3]
    return next(i for i, month in enumerate(MONTHS, 1) if month.startswith(stem))


def _overlaps(start: int, end: int, taken: Sequence[tuple[int, int]]) -> bool:
    return any(start < b and a < end for a, b in taken)


def _name_spans(text: str, taken: Sequence[tuple[int, int]]) -> list[Span]:
    """Runs of capitalised words (more than one letter) outside `taken`, joined by single
    spaces; a sentence's first word is dropped from its run."""
    runs: list[list[re.Match[str]]] = []
    for m in _WORD.finditer(text):
        word = m.group()
        capital = word[0].isupper() and len(word) > 1
        if not capital or _overlaps(m.start(), m.end(), taken):
            continue
        if _SENTENCE_END.search(text[: m.start()]) or not text[: m.start()].strip():
            continue  # a sentence's first word: capitalised by position
        last = runs[-1][-1] if runs else None
        if last is not None and text[last.end() : m.start()] == " ":
            runs[-1].append(m)
        else:
            runs.append([m])
    return [Span(r[0].start(), r[-1].end(), text[r[0].start() : r[-1].end()], "name") for r in runs]


class Sources:
    """The text an answer must draw its candidates from: the retrieved passages and the
    question (and whatever else the prompt holds)."""

    def __init__(self, text: str):
        self.text = " ".join(normalized(text).split())
        self.numbers = {_plain_number(m.group()) for m in _NUMBER.finditer(self.text)}
        self.dates: set[tuple[int | None, int | None, int | None]] = set()
        for span in candidate_spans(self.text):
            if span.date is not None:
                self.dates.update(_date_keys(span.date))

    def contains(self, span: Span) -> bool:
        """Whether `span` is grounded: a date whose named parts a source date names together,
        a number that a source states whole, a name whose words a source has in that order."""
        if span.kind == "date":
            return span.date in self.dates
        if span.kind == "number":
            return _plain_number(span.text) in self.numbers
        words = " ".join(normalized(span.text).split())
        return re.search(rf"(?<!\w){re.escape(words)}(?!\w)", self.text) is not None


def _plain_number(text: str) -> str:
    """A number without thousands separators ("1,200" and "1200" compare equal)."""
    return re.sub(r",(?=\d{3}\b)", "", text)


def _date_keys(
    date: tuple[int | None, int | None, int | None],
) -> set[tuple[int | None, int | None, int | None]]:
    """The keys a source date grounds: itself and each of its parts with the month."""
    day, month, year = date
    return {date, (day, month, None), (None, month, year)}


def held_from(text: str, spans: Sequence[Span]) -> int:
    """Where the answer must be held back from: the start of the first span that the text's
    end may still extend (the end inside it, or at most one word after it), else the end of the
    text before any incomplete character."""
    end = len(text.rstrip("\ufffd"))
    for span in spans:
        if _OPEN_AFTER.fullmatch(text[span.end : end]):
            return min(span.start, end)
    tail = _TAIL_WORD.search(text, 0, end)  # a capital letter that may begin a name ("I" → "Ida")
    return tail.start() if tail is not None and tail.group()[0].isupper() else end


class Release(NamedTuple):
    """What the answer may send now: `tokens` (in order, after those released before), and the
    span that stops the blended decode before it (None: none), its tokens never sent."""

    tokens: tuple[int, ...]
    ungrounded: Span | None = None


class AnswerGrounding:
    """One answer's grounding, token by token, on the thread that reads the answer: `push`
    each token as it comes, `end` when the answer ended; each says what may be sent. After a
    Release with an ungrounded span, nothing more is pushed (the answer goes on elsewhere)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, sources: Sources):
        self.tokenizer, self.sources = tokenizer, sources
        self.ids: list[int] = []
        self.released = 0
        self._ends = [0]  # characters of the text of ids[:k], k = 0..len(ids)

    def push(self, token: int) -> Release:
        self.ids.append(token)
        self._ends.append(len(self._text()))
        return self._release(final=False)

    def end(self) -> Release:
        """The answer ended (EOS, its budget, a full cache): every span is settled."""
        return self._release(final=True)

    def held_text(self) -> str:
        """The text of the tokens held back so far."""
        released = len(self._decoded(self.ids[: self.released]))
        return self._text()[released:]

    def _release(self, final: bool) -> Release:
        text = self._text()
        spans = candidate_spans(text)
        hold = len(text) if final else held_from(text, spans)
        ungrounded = next(
            (s for s in spans if s.end <= hold and not self.sources.contains(s)), None
        )
        if ungrounded is not None:
            hold = ungrounded.start
        count = self.released
        while count < len(self.ids) and self._ends[count + 1] <= hold:
            count += 1
        tokens = tuple(self.ids[self.released : count])
        self.released = count
        return Release(tokens, ungrounded)

    def _text(self) -> str:
        return self._decoded(self.ids)

    def _decoded(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
