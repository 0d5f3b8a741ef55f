"""A tiny workload run on the tiny random-weight model: the whole path, every figure's meaning."""

from __future__ import annotations

import json

import pytest

from bench.workload.modes import parse_modes
from bench.workload.report import format_table, write_report
from bench.workload.workload import Server, WorkloadOptions, run_workload
from tests.conftest import MUSIQUE_SLICE

# the guard would re-run the tiny random model's uncertain prompts in full
NAIVE = "naive:fidelity=fast"
VALUES = dict(
    database_url="",
    store_tiers="cpu,disk",
    store_cpu_bytes=64 << 20,
    store_disk_bytes=256 << 20,
    chunk_tokens=48,
    chunk_overlap=8,
    default_max_tokens=6,
    max_tokens_limit=64,
    epic_tokens=4,
    workers=2,
    queue_size=4,
)


@pytest.fixture(scope="module")
def run(tiny_loaded, embedder, tmp_path_factory):
    options = WorkloadOptions(
        corpus=MUSIQUE_SLICE,
        modes=tuple(parse_modes("naive:fidelity=fast,cacheblend-paper,cachecraft")),
        work_dir=tmp_path_factory.mktemp("workload"),
        start=0,
        records=2,
        requests=6,
        seed=1,
        concurrency=(1, 2),
        max_tokens=6,
        progress=False,
    )
    return run_workload(options, Server(tiny_loaded, embedder, VALUES), say=lambda _: None)


def cell(run, mode, load):
    return next(s for s in run.summaries if s.mode == mode and s.load == load)


def test_every_mode_and_load_answers_the_whole_trace(run):
    assert [(s.mode, s.load) for s in run.summaries] == [
        (m, load)
        for load in ("c=1", "c=2")
        for m in ("full", NAIVE, "cacheblend-paper", "cachecraft")
    ]
    for s in run.summaries:
        assert (s.requests, s.errors, s.rejections) == (6, 0, 0), s.first_error
        # percentiles of different requests need not nest (a p99 TTFT may pass the p95 latency);
        # each request's own first piece comes no later than its end
        assert s.ttft_p50 <= s.ttft_p95 <= s.ttft_p99 and s.latency_p50 <= s.latency_p95
        assert all(r["ttft_s"] <= r["latency_s"] for r in s.per_request)
        assert s.throughput > 0 and s.cpu_s_per_request > 0 and s.output_tokens_per_s > 0
        # decoding spans lie inside the cell's wall time, so decode tokens/s >= the tokens after
        # each first over the whole wall time
        after_first = s.output_tokens_per_s - s.throughput
        assert s.decode_tokens_per_s >= after_first * 0.999
    assert run.stats.requests == 6 and 0 <= run.stats.seen_before <= 1
    assert sum(
        (run.stats.same_order, run.stats.other_order, run.stats.partly, run.stats.fresh)
    ) == pytest.approx(1)


def test_full_is_its_own_reference_and_work_baseline(run):
    full = cell(run, "full", "c=1")
    assert full.work_vs_full == pytest.approx(1.0)
    assert (full.fidelity.exact_match, full.fidelity.first_top1) == (1.0, 1.0)
    assert full.fidelity.first_kl == pytest.approx(0.0, abs=1e-9)
    assert full.fidelity.answer_top1 == 1.0 and full.fidelity.answer_kl == pytest.approx(
        0.0, abs=1e-9
    )
    assert (
        full.recompute_share == 1.0 and full.tier_hits.get("disk", 0) == 0
    )  # full reads no cached KV


def test_reuse_modes_read_base_kv_and_do_less_work(run):
    naive = cell(run, NAIVE, "c=1")
    assert naive.recompute_share == 0.0
    assert naive.work_vs_full < 0.5  # only the question's rows run
    assert sum(naive.tier_hits.values()) > 0
    assert naive.fidelity.compared == 6
    assert 0.0 <= naive.fidelity.answer_top1 <= 1.0 and naive.fidelity.answer_kl >= 0.0


def test_the_store_s_kv_after_each_cell_is_reported_by_kind_and_codec(run):
    full, naive = cell(run, "full", "c=1"), cell(run, NAIVE, "c=1")
    assert set(full.kv_bytes) == {
        "base:float16"
    }  # full leaves nothing; the snapshot's bases are there
    assert (
        0 < full.kv_bytes["base:float16"] <= run.snapshot.kv_bytes
    )  # payload bytes; files add headers
    assert naive.kv_bytes == full.kv_bytes  # base-only modes leave no context variants
    for s in run.summaries:
        assert s.kv_bytes["base:float16"] >= full.kv_bytes["base:float16"]
        assert all(kind in ("base:float16", "context:float16") for kind in s.kv_bytes)
    assert "KV MiB" in format_table(run.summaries)


def test_only_variant_builds_count_as_background(run):
    for s in run.summaries:
        if s.mode != "cachecraft":  # the others build no variants
            assert s.background_share == 0.0, s.mode
        assert 0.0 <= s.background_share < 1.0


def test_report_and_snapshot_reuse(run, tiny_loaded, embedder, tmp_path):
    path = write_report(run, tmp_path / "report", "kvmosaic bench workload (test)")
    text = path.read_text()
    assert "of retrieved chunks had been retrieved before" in text and "cachecraft" in text
    assert "tiers cpu, disk;" in text  # the settings hold them as "cpu,disk"
    assert "KV in the store after each cell:" in text and "- full c=1: base:float16 " in text
    for name in ("ttft_cdf.png", "throughput.png", "work.png", "fidelity_vs_speedup.png"):
        assert (tmp_path / "report" / name).stat().st_size > 1000
        assert f"]({name})" in text
    data = json.loads((tmp_path / "report" / "results.json").read_text())
    assert len(data["cells"]) == 8 and data["trace_stats"]["requests"] == 6
    assert len((tmp_path / "report" / "trace.jsonl").read_text().splitlines()) == 6
    assert "work/full" in format_table(run.summaries)
    assert not run.snapshot.reused
    again = WorkloadOptions(
        corpus=MUSIQUE_SLICE,
        modes=tuple(parse_modes("full")),
        work_dir=run.options.work_dir,
        start=0,
        records=2,
        requests=2,
        concurrency=(1,),
        max_tokens=2,
        progress=False,
    )
    second = run_workload(again, Server(tiny_loaded, embedder, VALUES), say=lambda _: None)
    assert second.snapshot.reused and second.snapshot.chunks == run.snapshot.chunks
    assert not any(
        (run.options.work_dir / "runs").iterdir()
    )  # finished runs leave no data dir behind


def test_eager_and_lazy_ingest_make_different_snapshots(tmp_path):
    from app.settings import Settings
    from bench.workload.corpus import load_corpus, snapshot_key

    corpus = load_corpus(MUSIQUE_SLICE, 0, 1)
    keys = {
        kv: snapshot_key(corpus, Settings(data_dir=tmp_path, ingest_kv=kv), "fp")
        for kv in ("eager", "lazy")
    }
    assert keys["eager"] != keys["lazy"]
    # a capacity is not part of the snapshot: capped and uncapped cells share one
    assert (
        snapshot_key(corpus, Settings(data_dir=tmp_path, store_disk_bytes=1 << 20), "fp")
        == keys["eager"]
    )


def test_every_cell_reports_each_request(run):
    import statistics

    for s in run.summaries:
        assert [r["index"] for r in s.per_request] == sorted(
            r["index"] for r in s.per_request
        )  # c=1: trace order
        assert len(s.per_request) == s.requests and {
            len(r["chunk_ids"]) for r in s.per_request
        } != {0}
        assert [r["ttft_s"] for r in s.per_request] == s.ttfts
    full, naive = cell(run, "full", "c=1"), cell(run, NAIVE, "c=1")
    assert all(
        r["margin"] is None and r["first_kl"] == 0.0 and r["same_answer"] for r in full.per_request
    )
    assert all(
        r["margin"] is not None and r["margin"] >= 0 for r in naive.per_request
    )  # measured, not acted on
    # the cell's means are the means of its rows
    assert statistics.fmean(r["first_kl"] for r in naive.per_request) == pytest.approx(
        naive.fidelity.first_kl
    )
    assert statistics.fmean(r["first_top1"] for r in naive.per_request) == pytest.approx(
        naive.fidelity.first_top1
    )
    json.dumps([s.as_dict() for s in run.summaries])  # the rows serialize


def test_the_floor_is_full_in_another_order_and_accuracy_is_paired_with_full(run):
    from bench.workload.report import format_answers, run_json

    floor = run.floor
    assert floor is not None and 1 <= floor.compared <= 6
    assert floor.first_kl > 0.0  # another chunk order is another prompt, even for full prefill
    assert 0.0 <= floor.exact_match <= 1.0 and 0.0 <= floor.rouge_l <= 1.0
    # MuSiQue records carry gold answers: every cell is scored, full against itself pairs to
    # exactly 0
    assert set(run.accuracy) == {f"{s.mode} @ {s.load}" for s in run.summaries}
    full = run.accuracy["full @ c=1"]
    assert full.scored == 6 and (
        full.versus_full.mean,
        full.versus_full.low,
        full.versus_full.high,
    ) == (0, 0, 0)
    assert all(0.0 <= a.accuracy.mean <= 1.0 for a in run.accuracy.values())
    text = format_answers(run)
    assert (
        text.startswith("floor: full in another chunk order")
        and "accuracy cachecraft @ c=2" in text
    )
    assert run_json(run)["floor"]["compared"] == floor.compared
