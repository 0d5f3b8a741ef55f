"""`kvmosaic bench retrieval` on small sizes: exhaustive IVF equals flat; the figures are sane."""

from __future__ import annotations

import json

from bench.retrieval import RetrievalBenchOptions, run_retrieval_bench, write_json
from retrieval import ivf


def test_ivf_probing_every_list_has_perfect_recall(tmp_path):
    nlist = ivf.default_nlist(3000)
    options = RetrievalBenchOptions(sizes=(3000,), dim=32, queries=20, nprobe=nlist, latent=8)
    (row,) = run_retrieval_bench(options, log=lambda line: None)
    assert row.nlist == nlist and row.recall_at_10 == 1.0
    assert row.flat_ms_p50 > 0 and row.ivf_ms_p50 > 0 and row.speedup > 0
    assert row.flat_mib == 3000 * (32 * 4 + 8) / 2**20 < row.ivf_mib
    write_json([row], options, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["size"] == 3000


def test_fewer_probes_trade_recall(tmp_path):
    options = RetrievalBenchOptions(sizes=(3000,), dim=32, queries=30, nprobe=1, latent=8)
    (row,) = run_retrieval_bench(options, log=lambda line: None)
    assert 0.0 < row.recall_at_10 < 1.0
