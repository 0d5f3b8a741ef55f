"""`bench fidelity --store-codecs`: the same requests with chunk KV through each codec."""

from __future__ import annotations

import dataclasses

import pytest

from bench.fidelity.codecs import (
    CodecOptions,
    format_codec_table,
    paired_kl_change,
    run_codec_fidelity,
)
from tests.conftest import MUSIQUE_SLICE


def test_codecs_run_the_same_requests_and_report_their_cost(tiny_engine):
    options = CodecOptions(
        dataset=MUSIQUE_SLICE,
        start=0,
        n=2,
        chunks=3,
        codecs=("float32", "float16", "int4", "k4v3"),
        modes=("full", "cacheblend", "naive"),
        max_new_tokens=4,
    )
    report = run_codec_fidelity(tiny_engine, options, progress=False)
    sizes = report.bytes_per_token
    assert (
        sizes["float32"] == 4 * 2 * 2 * 4 * 16
    )  # tiny model: 4 layers x K,V x 2 heads x 16 dims x 4 bytes
    assert sizes["float16"] == sizes["float32"] / 2 and sizes["int4"] < sizes["float16"] / 2
    assert {(r.codec, r.mode) for r in report.rows} == {
        (c, m) for c in options.codecs for m in ("cacheblend", "naive")
    }
    assert sizes["k4v3"] < sizes["int4"]
    assert all(len(r.kl) == len(r.answer_top1) == len(r.answer_kl) == 2 for r in report.rows)
    # teacher forcing along full's answer: shares in [0, 1]; position 0 is the first token
    assert all(
        0.0 <= r.answer_top1_agreement <= 1.0 and r.mean_answer_kl >= 0.0 for r in report.rows
    )
    for row in report.rows:  # a first token off full's cannot follow full's whole answer
        assert all(share < 1.0 for share, same in zip(row.answer_top1, row.top1) if not same)
    naive = [report.row(c, "naive").kl for c in options.codecs]
    assert naive[0] != naive[2]  # int4 changed the reused KV, so the naive logits moved
    table = format_codec_table(report)
    assert (
        "k4v3" in table
        and "dKL" in table
        and "s.e." in table
        and "ans top1" in table
        and "guard" in table
    )
    change, error = paired_kl_change(report.row("int4", "naive"), report.row("float32", "naive"))
    first, second = (a - b for a, b in zip(naive[2], naive[0]))
    assert change == pytest.approx((first + second) / 2) and error == pytest.approx(
        abs(first - second) / 2
    )
    assert paired_kl_change(report.row("float32", "naive"), report.row("float32", "naive")) == (
        0.0,
        0.0,
    )
    fast = run_codec_fidelity(
        tiny_engine, dataclasses.replace(options, n=1, fidelity="fast"), progress=False
    )
    assert not any(any(r.escalated) for r in fast.rows)  # `fast` never re-runs in full


def test_unknown_codec_fails_before_any_work(tiny_engine):
    options = CodecOptions(dataset=MUSIQUE_SLICE, n=1, codecs=("float16", "int3"))
    with pytest.raises(ValueError, match="int3"):
        run_codec_fidelity(tiny_engine, options, progress=False)
