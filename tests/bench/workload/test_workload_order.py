"""A tiny workload run with the chunk order per cell (tiny random-weight model): each cell
reports its context tokens served exact / blended / computed, the run its oracle line, and a
trace of distinct questions runs."""

from __future__ import annotations

import json

import pytest

from bench.workload.modes import parse_modes
from bench.workload.report import format_table, run_json
from bench.workload.workload import Server, WorkloadOptions, run_workload
from tests.bench.workload.test_workload import VALUES
from tests.conftest import MUSIQUE_SLICE

MODES = "prefix-apc,prefix,cachecraft"  # the server's default order is cache-aware


@pytest.fixture(scope="module")
def run(tiny_loaded, embedder, tmp_path_factory):
    options = WorkloadOptions(
        corpus=MUSIQUE_SLICE,
        modes=tuple(parse_modes(MODES)),
        work_dir=tmp_path_factory.mktemp("workload-order"),
        start=0,
        records=2,
        requests=6,
        seed=1,
        concurrency=(1,),
        max_tokens=4,
        progress=False,
    )
    return run_workload(options, Server(tiny_loaded, embedder, VALUES), say=lambda _: None)


def cell(run, mode):
    return next(s for s in run.summaries if s.mode == mode)


def test_every_cell_reports_how_its_context_tokens_were_served(run):
    for s in run.summaries:
        assert (s.requests, s.errors) == (6, 0), s.first_error
        assert sum(s.served.values()) == pytest.approx(1.0)
        assert (
            s.served["exact"] <= run.oracle.exact_share + 1e-9
        )  # nothing serves more exactly than the oracle
        assert all(sum(r["served"]) > 0 for r in s.per_request)
    full, apc = cell(run, "full"), cell(run, "prefix-apc")
    assert full.served["computed"] == 1.0 and full.reordered_share == 0.0
    assert apc.served["blended"] == 0.0 and apc.served["exact"] > 0  # prefix never blends
    assert apc.reordered_share == 0.0  # retrieval order: the vLLM-APC baseline
    assert cell(run, "prefix").served["blended"] == 0.0


def test_the_table_and_the_json_carry_the_shares_and_the_oracle(run):
    table = format_table(run.summaries)
    assert all(column in table for column in ("exact", "blend", "comp", "reord"))
    data = json.loads(json.dumps(run_json(run), default=str))
    assert data["oracle"]["context_tokens"] > 0 and 0 <= data["oracle"]["exact_share"] <= 1
    assert set(data["cells"][0]["served"]) == {"exact", "blended", "computed"}
    assert run.oracle.line().startswith("oracle")


def test_a_trace_of_distinct_questions_runs(tiny_loaded, embedder, tmp_path):
    options = WorkloadOptions(
        corpus=MUSIQUE_SLICE,
        modes=tuple(parse_modes("prefix:order=cache-aware")),
        work_dir=tmp_path,
        start=0,
        records=2,
        requests=2,
        distinct=True,
        seed=0,
        concurrency=(1,),
        max_tokens=2,
        answer_fidelity=False,
        progress=False,
    )
    done = run_workload(options, Server(tiny_loaded, embedder, VALUES), say=lambda _: None)
    assert len({r.question for r in done.trace}) == 2 and done.stats.requests == 2
    assert [s.requests for s in done.summaries] == [2, 2]
