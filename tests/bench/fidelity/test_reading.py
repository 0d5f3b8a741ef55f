"""The Hugging Face path's judge: rows scored against the golds, paired against full."""

from __future__ import annotations

from bench.fidelity.adapt import distiller_of
from bench.fidelity.cases import generate_cases
from bench.fidelity.reading import judge
from tests.engine.helpers import engine_with_packets


def test_rows_are_scored_on_the_golds_and_paired_case_by_case(smol_tokenizer, tmp_path):
    engine = engine_with_packets(smol_tokenizer, tmp_path, None)
    distiller = distiller_of(engine)
    cases = generate_cases(3, 2)
    golds = {case["question"]: case["answers"][0] for case in cases}
    question_of = {engine.prompts.question_ids(q): q for q in golds}

    def gold(example):  # answers every case right
        text = golds[question_of[example.question_ids]]
        return tuple(smol_tokenizer(text, add_special_tokens=False).input_ids)

    readers = {"echo": lambda e: e.answer_ids, "gold": gold}
    rows = judge(engine, distiller, cases, readers, 3, 2, "echo")
    full = rows["full"]["accuracy"][0]
    assert full < 1.0  # a random model's two tokens hold no gold
    assert rows["echo"]["same_as_full"] == 1.0 and rows["echo"]["vs_full"][0] == 0.0
    assert rows["gold"]["accuracy"][0] == 1.0
    assert rows["gold"]["vs_echo"][0] == rows["gold"]["vs_full"][0] == 1.0 - full
