"""The request trace: read from a file or generated, and what its retrieval reuses.

A trace file is JSON lines, one request a line: `{"question": "...", "top_k": 6}` (`top_k`
optional). The generator draws from a dataset's questions with a Zipf popularity (a few
questions are asked often, most rarely) and turns some repeats into reformulations: the same
need in other words, as users ask it, so retrieval returns an overlapping chunk set in another
order, or asked together with part of another popular question (a follow-up that brings other
companions along). `distinct_trace` asks each question once instead (no repeats at all). Reuse is
not assumed from that recipe: `trace_stats` measures it on the chunks that
retrieval really returned.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.errors import InvalidRequest

STOPWORDS = frozenset(
    "a an the of in on at to for by with from and or is was were are be been did do does "
    "what which who whom whose when where why how that this these those it its as into "
    "there their than".split()
)
# Lead-ins a person puts before the same question; with keywords-only forms they move the embedding.
LEAD_INS = (
    "Quick question: ",
    "I'd like to know this. ",
    "Can you look up the following? ",
    "Tell me, ",
)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace; `need` numbers the underlying question (None: from a file)."""

    question: str
    top_k: int | None = None
    need: int | None = None
    reformulated: bool = False


@dataclass(frozen=True)
class TraceStats:
    """Reuse in a trace, from the chunk ids retrieval returned per request.

    seen_before: share of retrieved chunks that an earlier request had retrieved.
    same_order / other_order / partly / fresh: share of requests whose chunk list equals an
    earlier one; whose set equals an earlier set in another order; that shares some chunks
    with earlier requests; that shares none.
    """

    requests: int
    distinct_chunks: int
    seen_before: float
    same_order: float
    other_order: float
    partly: float
    fresh: float
    reformulated: float


def read_trace(path: Path) -> list[TraceRequest]:
    """Requests from a JSON-lines file; InvalidRequest naming the line of the first bad one."""
    requests = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{path}:{number}: not JSON ({exc.msg})") from None
        question = item.get("question") if isinstance(item, dict) else None
        top_k = item.get("top_k") if isinstance(item, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest(f'{path}:{number}: expected {{"question": text, "top_k"?: int}}')
        if top_k is not None and (
            not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 20
        ):
            raise InvalidRequest(f"{path}:{number}: top_k must be an integer from 1 to 20")
        requests.append(TraceRequest(question.strip(), top_k))
    if not requests:
        raise InvalidRequest(f"{path}: the trace has no requests")
    return requests


def write_trace(path: Path, requests: Sequence[TraceRequest]) -> None:
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in requests), encoding="utf-8")


def generate_trace(
    questions: Sequence[str],
    num_requests: int,
    seed: int = 0,
    zipf_s: float = 1.2,
    reformulate: float = 0.8,
) -> list[TraceRequest]:
    """`num_requests` requests over `questions`: Zipf(`zipf_s`) popularity over a seeded ranking;
    a question asked before is reformulated with probability `reformulate`."""
    if not questions:
        raise InvalidRequest("no questions to draw a trace from")
    if num_requests < 1:
        raise InvalidRequest("a trace needs at least one request")
    rng = random.Random(seed)
    ranking = list(range(len(questions)))
    rng.shuffle(ranking)
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(ranking))]
    asked: set[int] = set()
    requests = []
    for need in rng.choices(ranking, weights=weights, k=num_requests):
        again = need in asked and rng.random() < reformulate
        other = questions[rng.choices(ranking, weights=weights)[0]]
        text = (
            reformulation(questions[need], rng, other if other != questions[need] else "")
            if again
            else questions[need]
        )
        requests.append(TraceRequest(text, None, need, again))
        asked.add(need)
    return requests


def distinct_trace(
    questions: Sequence[str], num_requests: int, seed: int = 0
) -> list[TraceRequest]:
    """`num_requests` distinct questions (each asked once, no reformulations) in a seeded order:
    the reuse left is only what retrieval shares between different needs."""
    unique = list(dict.fromkeys(questions))
    if num_requests < 1:
        raise InvalidRequest("a trace needs at least one request")
    if num_requests > len(unique):
        raise InvalidRequest(
            f"a trace of distinct questions needs {num_requests} questions; the corpus has "
            f"{len(unique)} (pool more records, or ask for fewer requests)"
        )
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    return [TraceRequest(unique[i], None, i) for i in order[:num_requests]]


def reformulation(question: str, rng: random.Random, other: str = "") -> str:
    """The same need in other words: its keywords, keywords in another order, a lead-in, or,
    given `other` (another popular question), its keywords asked together with half of those."""
    keywords = _keywords(question)
    form = rng.randrange(4 if other else 3)
    if form == 0:
        return " ".join(keywords)
    if form == 1:
        half = max(1, len(keywords) // 2)
        return " ".join(keywords[half:] + keywords[:half]) + "?"
    if form == 2:
        return rng.choice(LEAD_INS) + question[:1].lower() + question[1:]
    extra = _keywords(other)
    return " ".join(keywords) + ", and " + " ".join(extra[: max(1, len(extra) // 2)]) + "?"


def _keywords(question: str) -> list[str]:
    words = re.findall(r"[\w'-]+", question)
    return [w for w in words if w.lower() not in STOPWORDS] or words


def trace_stats(requests: Sequence[TraceRequest], retrieved: Sequence[Sequence[int]]) -> TraceStats:
    """Reuse of a trace whose request i retrieved the chunk ids `retrieved[i]` (in order)."""
    lists: set[tuple[int, ...]] = set()
    sets: set[frozenset[int]] = set()
    seen: set[int] = set()
    counts = dict(same_order=0, other_order=0, partly=0, fresh=0)
    total = repeated = 0
    for chunk_ids in retrieved:
        ordered, as_set = tuple(chunk_ids), frozenset(chunk_ids)
        shared = len(as_set & seen)
        kind = (
            "same_order"
            if ordered in lists
            else "other_order"
            if as_set in sets
            else "partly"
            if shared
            else "fresh"
        )
        counts[kind] += 1
        total, repeated = total + len(as_set), repeated + shared
        lists.add(ordered), sets.add(as_set), seen.update(as_set)
    n = max(1, len(retrieved))
    return TraceStats(
        len(retrieved),
        len(seen),
        repeated / max(1, total),
        *(counts[k] / n for k in ("same_order", "other_order", "partly", "fresh")),
        sum(r.reformulated for r in requests) / max(1, len(requests)),
    )
