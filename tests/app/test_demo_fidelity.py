"""The default mode answers demo-corpus questions as full prefill does, cold and warm (SmolLM2).

The whole shipped demo corpus is ingested into a fresh store; every question is asked by
`full`, then by the server's default mode and fidelity twice: cold (the first pass, variants
accumulating as a server's would) and warm (a second pass once background builds are done).
The answers must match full's: ROUGE-L >= 0.9 on average and for the lighthouse question,
whose blended answer went wrong before the fidelity guard ("12 January 1987"). The first-token
check alone reached a mean ROUGE-L of 0.43 (the answers open with a confident "The ..." and
drift later); the check while decoding (engine/guard.py) is what brings them back.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from engine.bench.metrics import rouge_l
from retrieval.sources import load_sources
from tests.app.conftest import make_settings

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parents[2] / "app" / "demo_corpus"
LIGHTHOUSE = "When was the Hollin Point Lighthouse first lit?"
QUESTIONS = [
    LIGHTHOUSE,
    "Who designed the Hollin Point Lighthouse?",
    "Who was the last keeper of the Hollin Point Lighthouse?",
    "How long is the Long Arm breakwater?",
    "When was the Saltcote Tide Mill restored?",
    "How long does the Guillemot ferry take to cross to Skarra?",
    "How many pairs of puffins nest on Skarra?",
    "When did the Lantern Tide festival begin?",
    "How many boats does the fishers' cooperative have today?",
    "What is Ellery cake made of?",
    "How many people live in Port Ellery?",
    "What does the Saltcote library keep from the lighthouse?",
]
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


def test_default_mode_answers_like_full_cold_and_warm(demo_services):
    full = {q: answer(demo_services, q, "full").text for q in QUESTIONS}
    assert "1811" in full[LIGHTHOUSE]
    passes = {}
    for name in ("cold", "warm"):
        replies = {q: answer(demo_services, q) for q in QUESTIONS}
        demo_services.chunk_cache.drain()  # background variant builds, before the next pass
        passes[name] = {q: rouge_l(r.text, full[q]) for q, r in replies.items()}
        assert all(r.result.guard is not None for r in replies.values())
    for name, scores in passes.items():
        misses = {q: round(s, 2) for q, s in scores.items() if s < 0.9}
        assert scores[LIGHTHOUSE] >= 0.9, (name, misses)
        assert statistics.fmean(scores.values()) >= 0.9, (name, misses)
