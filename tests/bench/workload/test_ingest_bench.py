"""`bench ingest` on the tiny model: both ingest settings store the same corpus, the prefill row
is one prompt of about the asked length, and the table's ratios are against those rows."""

from __future__ import annotations

import pytest

from app.cli import build_parser
from bench.cli.ingest import _runs
from bench.workload.corpus import load_corpus
from bench.workload.ingest import IngestOptions, IngestRow, format_ingest_table, run_ingest_bench
from bench.workload.workload import Server
from engine.errors import InvalidRequest
from tests.conftest import MUSIQUE_SLICE

VALUES = dict(database_url="", store_tiers="disk", chunk_tokens=48, chunk_overlap=8)


@pytest.fixture(scope="module")
def rows(tiny_loaded, embedder, tmp_path_factory):
    corpus = load_corpus(MUSIQUE_SLICE, 0, 1)
    options = IngestOptions(
        work_dir=tmp_path_factory.mktemp("ingest"),
        runs=((1, "engine"), (512, "engine"), (512, "bfloat16")),
        prompt_tokens=300,
        prefill_repeats=1,
        progress=False,
    )
    opened = []

    def open_services(data_dir, overrides):
        opened.append(overrides)
        return Server(tiny_loaded, embedder, {**VALUES, **overrides}).open(data_dir)

    result = run_ingest_bench(corpus, options, open_services, say=lambda _: None)
    assert opened[:3] == [
        {"ingest_batch_tokens": b, "ingest_kv": "eager", "encode_dtype": d} for b, d in options.runs
    ]
    assert not any(options.work_dir.iterdir())  # scratch data dirs are removed
    return result


def test_every_setting_ingests_the_whole_corpus(rows):
    one, packed, rounded, prefill = rows
    assert (
        one.tokens == packed.tokens == rounded.tokens > 0
        and one.chunks == packed.chunks == rounded.chunks > 0
    )
    assert (
        one.label == "ingest, one chunk per pass, float32"
        and packed.label == "ingest, packed (512 rows/pass), float32"
    )
    assert rounded.label == "ingest, packed (512 rows/pass), bfloat16"
    assert one.seconds > 0 and packed.seconds > 0


def test_the_prefill_row_is_one_prompt_of_about_the_asked_length(rows):
    prefill = rows[-1]
    assert prefill.label.startswith("engine full prefill")
    assert (
        300 <= prefill.tokens < 300 + 48 + 200
    )  # whole chunks up to 300 tokens, then the question and template


def test_table_ratios_are_against_the_first_and_last_rows():
    rows = [IngestRow("a", 100, 2, 1.0), IngestRow("b", 100, 2, 0.5), IngestRow("p", 400, 8, 2.0)]
    lines = format_ingest_table(rows).splitlines()
    assert lines[2].split()[-2:] == ["2.00x", "1.00x"] and lines[1].split()[-2:] == [
        "1.00x",
        "0.50x",
    ]


def test_runs_flag():
    assert _runs(None, 2048, "auto") == ((1, "engine"), (2048, "engine"), (2048, "auto"))
    assert _runs(None, 1, "engine") == ((1, "engine"),)
    assert _runs("1,64:bfloat16", 2048, "auto") == ((1, "engine"), (64, "bfloat16"))
    for bad in ("0", "x", "", "64:int8"):
        with pytest.raises(InvalidRequest):
            _runs(bad, 2048, "auto")
    assert (
        build_parser().parse_args(["bench", "ingest", "--runs", "1,256:auto"]).runs == "1,256:auto"
    )
