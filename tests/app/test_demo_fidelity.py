"""The default mode answers demo-corpus questions as correctly as full prefill, cold and warm.

The yardstick of docs/benchmarks/fidelity.md, on real text (SmolLM2): the whole shipped demo
corpus is ingested into a fresh store; every question (each with its gold answer from the
corpus) is asked by `full`, then by `full` again with the same retrieved chunks in reverse
order (the retriever's order is one arbitrary choice: full's own stability floor), then by the
server's default mode and fidelity twice: cold (the first pass, variants accumulating as a
server's would) and warm (a second pass once background builds are done).
Each pass of the default mode must be right on at least as many questions as full prefill in
the worse of its two orders, deviate from full's answers no more than the reordered full does
(mean ROUGE-L), and keep the lighthouse answer, which blending got wrong before the fidelity
guard ("12 January 1987" for 1811).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from bench.fidelity.accuracy import score_answer
from bench.fidelity.metrics import rouge_l
from engine.model.decode import SamplingParams
from engine.planners import Mode
from retrieval.sources import load_sources
from tests.app.conftest import make_settings

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parents[2] / "app" / "demo_corpus"
LIGHTHOUSE = "When was the Hollin Point Lighthouse first lit?"
GOLDS = {  # each question's answer as the corpus states it
    LIGHTHOUSE: ["1811", "3 November 1811"],
    "Who designed the Hollin Point Lighthouse?": ["Robert Skene", "Skene"],
    "Who was the last keeper of the Hollin Point Lighthouse?": ["Ida Marrin"],
    "How long is the Long Arm breakwater?": ["640 metres", "640 meters", "640 m"],
    "When was the Saltcote Tide Mill restored?": ["2006"],
    "How long does the Guillemot ferry take to cross to Skarra?": [
        "forty minutes",
        "40 minutes",
    ],
    "How many pairs of puffins nest on Skarra?": ["4,000", "4000", "four thousand"],
    "When did the Lantern Tide festival begin?": ["1958"],
    "How many boats does the fishers' cooperative have today?": ["11", "eleven"],
    "What is Ellery cake made of?": ["oats, treacle and ginger", "oats"],
    "How many people live in Port Ellery?": ["2,300", "2300"],
    "What does the Saltcote library keep from the lighthouse?": [
        "tide logbooks",
        "logbooks",
    ],
}
QUESTIONS = list(GOLDS)

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def demo_services(smol_engine, embedder, tmp_path_factory):
    from app.services import Services
    from app.settings import Settings

    defaults = Settings()
    settings = make_settings(
        tmp_path_factory.mktemp("demo"),
        default_mode=defaults.default_mode,
        fidelity=defaults.fidelity,
        chunk_tokens=defaults.chunk_tokens,
        chunk_overlap=defaults.chunk_overlap,
        epic_tokens=defaults.epic_tokens,
        max_upload_bytes=defaults.max_upload_bytes,
        max_question_chars=defaults.max_question_chars,
        default_max_tokens=MAX_TOKENS,
        workers=1,
        ingest_lease_s=600,
    )  # a busy CI box must not lose the lease mid-ingest
    services = Services.start(settings, engine=smol_engine, embedder=embedder)
    for doc in load_sources([CORPUS]):
        services.ingestor.ingest(doc)
    yield services
    services.close()


def answer(services, question: str, mode: str | None = None):
    return services.rag.ask(services.rag.query(question, mode=mode))


def reversed_full(services, reply, question: str) -> str:
    """Full prefill of `reply`'s chunks in reverse order, decoded as the server decodes."""
    loaded = services.chunk_cache.load(list(reversed(reply.retrieved)), Mode.named("full"))
    try:
        result = services.engine.prefill(
            loaded.inputs, question, mode=Mode.named("full"), max_new_tokens=MAX_TOKENS
        )
    finally:
        loaded.release()
    return "".join(services.engine.generate(result, SamplingParams(max_new_tokens=MAX_TOKENS)))


def correct(texts: dict[str, str]) -> int:
    return sum(int(score_answer(text, GOLDS[q]).contains) for q, text in texts.items())


def mean_rouge(texts: dict[str, str], reference: dict[str, str]) -> float:
    return statistics.fmean(rouge_l(texts[q], reference[q]) for q in QUESTIONS)


def test_default_mode_is_as_correct_as_full_prefill_cold_and_warm(demo_services):
    replies = {q: answer(demo_services, q, "full") for q in QUESTIONS}
    full = {q: r.text for q, r in replies.items()}
    assert all(len(r.retrieved) > 1 for r in replies.values())  # an order to change
    reordered = {q: reversed_full(demo_services, r, q) for q, r in replies.items()}
    assert "1811" in full[LIGHTHOUSE]
    least_correct = min(correct(full), correct(reordered))
    floor = mean_rouge(reordered, full)
    for name in ("cold", "warm"):
        served = {q: answer(demo_services, q) for q in QUESTIONS}
        demo_services.chunk_cache.drain()  # background variant builds, before the next pass
        assert all(r.result.guard is not None for r in served.values())
        texts = {q: r.text for q, r in served.items()}
        wrong = {q: t for q, t in texts.items() if not score_answer(t, GOLDS[q]).contains}
        assert "1811" in texts[LIGHTHOUSE], (name, texts[LIGHTHOUSE])
        assert correct(texts) >= least_correct, (name, least_correct, wrong)
        assert mean_rouge(texts, full) >= floor, (name, floor, mean_rouge(texts, full))
