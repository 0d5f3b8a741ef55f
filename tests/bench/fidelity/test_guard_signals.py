"""bench.fidelity.guard_signals: the signals, their rank correlation and the KL left per re-run
budget."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.fidelity.guard_signals import (
    SignalOptions,
    SignalRow,
    first_token_signals,
    kl_left,
    measure,
    spearman,
    summarize,
    suspicion_of,
)
from tests.engine.helpers import PASSAGES


def test_spearman_ranks_ties_and_degenerate_input():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(
        0.894427, abs=1e-6
    )  # average ranks for ties
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3])) and math.isnan(spearman([1.0], [2.0]))
    with pytest.raises(ValueError):
        spearman([1, 2], [1])


def test_first_token_signals_of_peaked_and_flat_logits():
    peaked = torch.tensor([10.0, 0.0, 0.0, 0.0])
    flat = torch.zeros(4)
    p, f = first_token_signals(peaked), first_token_signals(flat)
    assert p["margin"] == pytest.approx(10.0) and p["top_prob"] > 0.99 and p["entropy"] < 0.01
    assert f["margin"] == pytest.approx(0.0) and f["top_prob"] == pytest.approx(0.25)
    assert f["entropy"] == pytest.approx(math.log(4))


def _rows(kls, margins):
    return [SignalRow(i, kl, margin, 1.0, 0.5) for i, (kl, margin) in enumerate(zip(kls, margins))]


def test_kl_left_reruns_the_most_suspicious_first():
    rows = _rows([0.4, 0.1, 0.0, 0.3], [0.5, 3.0, 4.0, 1.0])  # low margin = suspicious
    suspicion = suspicion_of(rows, "margin")
    assert kl_left(rows, suspicion, 0.0) == pytest.approx(0.2)
    assert kl_left(rows, suspicion, 0.25) == pytest.approx(0.1)  # record 0 (margin 0.5) re-run
    assert kl_left(rows, suspicion, 0.5) == pytest.approx(0.025)  # and record 3
    assert kl_left(rows, suspicion, 1.0) == 0.0


def test_summary_oracle_bounds_every_signal():
    rows = [
        SignalRow(i, kl, m, e, p)
        for i, (kl, m, e, p) in enumerate(
            [
                (0.3, 2.0, 3.0, 0.4),
                (0.05, 0.2, 1.0, 0.9),
                (0.2, 1.0, 2.5, 0.5),
                (0.01, 4.0, 0.5, 0.95),
            ]
        )
    ]
    table = summarize(rows)
    assert set(table) == {"margin", "entropy", "top_prob", "oracle"}
    assert table["oracle"]["spearman"] == pytest.approx(1.0) and table["entropy"][
        "spearman"
    ] == pytest.approx(1.0)
    for signal, figures in table.items():
        for key, left in figures.items():
            if key.startswith("kl_left"):
                assert table["oracle"][key] <= left + 1e-12, (signal, key)


def test_measure_on_the_tiny_model(tiny_engine, tmp_path):
    ctxs = [{"title": title, "text": text} for title, text in PASSAGES]
    records = [
        {"question": q, "answers": [], "ctxs": ctxs[i:] + ctxs[:i]}
        for i, q in enumerate(["Who wrote the first algorithm?", "What is a tide mill?"])
    ]
    dataset = tmp_path / "records.json"
    dataset.write_text(json.dumps(records))
    exact = measure(
        tiny_engine,
        SignalOptions(dataset=dataset, n=2, chunks=3, mode="full", chunk_tokens=12),
        progress=False,
    )
    naive = measure(
        tiny_engine,
        SignalOptions(dataset=dataset, n=2, chunks=3, mode="naive", chunk_tokens=12),
        progress=False,
    )
    assert [r.index for r in exact] == [0, 1] and all(
        r.kl == pytest.approx(0.0, abs=1e-9) for r in exact
    )
    assert all(r.kl > 1e-6 for r in naive)  # stale KV of the tiny model moves its first token
    assert all(0.0 < r.top_prob <= 1.0 and r.margin >= 0.0 and r.entropy >= 0.0 for r in naive)
