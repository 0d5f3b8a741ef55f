"""Judge ways of reading reused chunks on answerable cases, through the Hugging Face path.

Each case's passages (`PASSAGES_PER_CASE`) in two seeded chunk orders; full prefill answers
first (greedy, engine/adapt/train.py's `Distiller`), then every other row from the same prompt
(`Reader`: the example in, the answer's ids out). Gold containment per row with its 95%
interval, paired against full and against `baseline`, and the share of answers identical to
full's. Used by the packets and APE screens (bench/fidelity/packets.py, ape_screen.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from tqdm import tqdm

from bench.fidelity.accuracy import bootstrap, paired_difference, per_case_means, score_answer
from bench.fidelity.adapt import PASSAGES_PER_CASE
from bench.fidelity.fidelity import chunk_orders
from engine.adapt.train import Distiller, Example
from engine.engine import Engine

Reader = Callable[[Example], tuple[int, ...]]
FULL = "full"


def judge(
    engine: Engine,
    distiller: Distiller,
    cases: list[dict[str, Any]],
    readers: Mapping[str, Reader],
    seed: int,
    max_new_tokens: int,
    baseline: str,
) -> dict[str, Any]:
    """Every row's answers on every case in two chunk orders (seeded by `seed` + the case's
    index), scored against the golds; each row's gain over `baseline` too."""
    rows = (FULL, *readers)
    scores: dict[str, list[float]] = {row: [] for row in rows}
    same: dict[str, list[float]] = {row: [] for row in rows}
    case_of: list[int] = []
    for index, case in enumerate(tqdm(cases, desc="judge", file=sys.stderr)):
        chunks = [
            engine.chunk_ids(c["text"], c.get("title", ""))
            for c in case["ctxs"][:PASSAGES_PER_CASE]
        ]
        question = engine.prompts.question_ids(case["question"])
        for order in chunk_orders(list(range(len(chunks))), 2, seed + index):
            example = distiller.full_example([chunks[i] for i in order], question, max_new_tokens)
            answers = {FULL: example.answer_ids}
            answers.update({row: read(example) for row, read in readers.items()})
            for row, ids in answers.items():
                text = str(engine.loaded.tokenizer.decode(list(ids), skip_special_tokens=True))
                scores[row].append(float(score_answer(text, case["answers"]).contains))
                same[row].append(float(ids == example.answer_ids))
            case_of.append(index)
    per_case = {row: per_case_means(scores[row], case_of) for row in rows}
    out: dict[str, Any] = {}
    for row in rows:
        accuracy = bootstrap(per_case[row])
        versus = paired_difference(per_case[row], per_case[FULL])
        gain = paired_difference(per_case[row], per_case[baseline])
        out[row] = {
            "accuracy": [accuracy.mean, accuracy.low, accuracy.high],
            "vs_full": [versus.mean, versus.low, versus.high],
            f"vs_{baseline}": [gain.mean, gain.low, gain.high],
            "same_as_full": sum(same[row]) / len(same[row]),
        }
    return out
