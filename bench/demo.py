"""`kvmosaic bench demo`: the demo corpus's questions, with exact golds, in every mode through
one fresh server, cold then warm.

The shipped demo corpus (app/demo_corpus/) is ingested into a new data dir; each pass asks every
question in every mode at the given fidelity through the server's own path (retrieve, order,
load, prefill, decode, store variants); background variant builds finish between passes, so
the second pass sees what the first left. A question counts as right when its answer contains
the exact gold as the corpus states it ("3 November 1811", not "1811"). What it prints is
accuracy, not speed: the machine may be busy.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.fidelity.accuracy import score_answer

CORPUS = Path(__file__).resolve().parents[1] / "app" / "demo_corpus"
LIGHTHOUSE = "When was the Hollin Point Lighthouse first lit?"
# each question's answer exactly as the corpus states it (variants of writing only)
EXACT_GOLDS: dict[str, tuple[str, ...]] = {
    LIGHTHOUSE: ("3 November 1811",),
    "Who designed the Hollin Point Lighthouse?": ("Robert Skene",),
    "Who was the last keeper of the Hollin Point Lighthouse?": ("Ida Marrin",),
    "How long is the Long Arm breakwater?": ("640 metres", "640 meters", "640 m"),
    "When was the Saltcote Tide Mill restored?": ("2006",),
    "How long does the Guillemot ferry take to cross to Skarra?": ("forty minutes", "40 minutes"),
    "How many pairs of puffins nest on Skarra?": ("4,000", "4000", "four thousand"),
    "When did the Lantern Tide festival begin?": ("1958",),
    "How many boats does the fishers' cooperative have today?": ("11", "eleven"),
    "What is Ellery cake made of?": ("oats, treacle and ginger",),
    "How many people live in Port Ellery?": ("2,300", "2300"),
    "What does the Saltcote library keep from the lighthouse?": ("tide logbooks",),
}
PASSES = ("cold", "warm")


@dataclass(frozen=True)
class PassResult:
    """One mode's answers in one pass."""

    mode: str
    run: str  # "cold" or "warm"
    answers: dict[str, str]
    outcomes: dict[str, str]  # the guard's outcome per question

    @property
    def right(self) -> int:
        return len(self.answers) - len(self.wrong)

    @property
    def wrong(self) -> list[int]:
        """1-based numbers (in `EXACT_GOLDS` order) of the questions answered wrong."""
        return [
            i
            for i, q in enumerate(EXACT_GOLDS, 1)
            if q in self.answers
            and not score_answer(self.answers[q], list(EXACT_GOLDS[q])).contains
        ]


def run_demo(
    settings_values: dict, modes: Sequence[str], fidelity: str, max_tokens: int
) -> list[PassResult]:
    """Every pass of every mode through one fresh server over the demo corpus."""
    from app.services import Services
    from app.settings import Settings
    from retrieval.sources import load_sources

    with tempfile.TemporaryDirectory(prefix="kvmosaic-demo-") as folder:
        settings = Settings(**{**settings_values, "data_dir": Path(folder)})
        _share_models(settings_values.get("data_dir") or Settings().data_dir, Path(folder))
        services = Services.start(settings)
        try:
            for doc in load_sources([CORPUS]):
                services.ingestor.ingest(doc)
            results = []
            for run in PASSES:
                results += [_ask_all(services, m, run, fidelity, max_tokens) for m in modes]
                services.chunk_cache.drain()  # background builds, before the next pass
            return results
        finally:
            services.close()


def _share_models(data_dir: Path, folder: Path) -> None:
    """The converted models of the configured data dir, seen from the scratch one."""
    (folder / "models").symlink_to(Path(data_dir).resolve() / "models")


def _ask_all(services, mode: str, run: str, fidelity: str, max_tokens: int) -> PassResult:
    answers, outcomes = {}, {}
    for question in EXACT_GOLDS:
        query = services.rag.query(question, mode=mode, fidelity=fidelity, max_tokens=max_tokens)
        answer = services.rag.ask(query)
        answers[question] = answer.text
        outcomes[question] = answer.result.guard.outcome
    return PassResult(mode, run, answers, outcomes)


def format_demo(results: Sequence[PassResult]) -> str:
    """Right answers per mode and pass, the lighthouse's answer, and the guard's outcomes."""
    lines = [f"{'mode':<12} {'pass':<5} {'right':>6}  wrong  lighthouse answer / guard outcomes"]
    for r in results:
        counts: dict[str, int] = {}
        for outcome in r.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        lighthouse = r.answers.get(LIGHTHOUSE, "").strip().replace("\n", " ")[:48]
        wrong = ",".join(map(str, r.wrong)) or "-"
        score = f"{r.right:>3}/{len(r.answers)}"
        lines.append(f"{r.mode:<12} {r.run:<5} {score}  {wrong:<5}  {lighthouse!r} / {shown}")
    return "\n".join(lines)
