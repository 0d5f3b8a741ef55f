"""StoreConfig validation, the store factory, and a smoke run of `kvmosaic bench store`."""

from __future__ import annotations

import pytest
import torch

from app.cli import build_parser
from app.store import StoreConfig, TierUnavailable, create_store, create_tier
from app.store.codec_names import CODEC_NAMES
from app.store.codecs import CODECS
from app.store.lazy import hidden_share
from bench.store.tiers import StoreBenchOptions, format_codec_sizes, run_overlap, run_throughput


@pytest.mark.parametrize(
    "bad",
    [
        dict(tiers=()),
        dict(tiers=("cpu", "cpu")),
        dict(tiers=("tape",)),
        dict(cpu_bytes=-1),
        dict(codec="int3"),
        dict(eviction="fifo"),
        dict(load_threads=0),
        dict(prefetch_layers=0),
    ],
)
def test_config_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        StoreConfig(**bad)


def test_every_codec_is_named_where_codecs_are_chosen():
    assert CODEC_NAMES == tuple(CODECS)
    assert build_parser().parse_args(["bench", "store", "--codec", "k4v3"]).codec == "k4v3"
    sizes = {line.split()[0]: line.split() for line in format_codec_sizes().splitlines()[1:]}
    # B/token, vs float16 @256 and @512
    assert sizes["k4v3"][1:] == ["5580", "0.242x", "5580", "0.242x"]


def test_factories(tmp_path):
    config = StoreConfig(tiers=("gpu", "cpu", "disk"), disk_dir=tmp_path, eviction="value")
    store = create_store(config)
    expected = ["gpu", "cpu", "disk"] if torch.cuda.is_available() else ["cpu", "disk"]
    assert store.names == expected and store.policy.name == "value"
    store.close()
    with pytest.raises(ValueError):
        create_tier("tape", config)
    if not torch.cuda.is_available():
        with pytest.raises(TierUnavailable):
            create_tier("gpu", config)
        with pytest.raises(TierUnavailable):
            create_store(StoreConfig(tiers=("gpu",)))


def test_bench_throughput_smoke(tmp_path):
    rows = run_throughput(
        StoreBenchOptions(tiers=("cpu", "disk"), repeats=1, fsync=False), tmp_path
    )
    assert [(r.tier, r.entry) for r in rows] == [
        ("cpu", "chunk-512"),
        ("disk", "chunk-512"),
        ("cpu", "10MiB"),
        ("disk", "10MiB"),
    ]
    assert rows[0].megabytes == pytest.approx(30 * 2 * 3 * 512 * 64 * 2 / 1e6)
    assert all(r.put_ratio > 0 and r.get_ratio > 0 for r in rows)
    assert not list(tmp_path.glob("kv/*/*.kvs"))  # the bench cleans up after itself


def test_hidden_share_is_a_fraction():
    assert hidden_share(load_s=2.0, wait_s=0.5) == 0.75
    assert hidden_share(load_s=2.0, wait_s=0.0) == 1.0
    # waited longer than the reads took (queueing on a busy machine): nothing hidden, not -0.017
    assert hidden_share(load_s=1.0, wait_s=1.017) == 0.0
    assert hidden_share(load_s=0.0, wait_s=0.1) == 0.0  # nothing read, nothing hidden


def test_bench_overlap_smoke(tiny_engine, tmp_path):
    """What the overlap bench reports, checked for consistency; how fast it ran is not checked."""
    options = StoreBenchOptions(chunks=2, chunk_tokens=48, blend_repeats=1, fsync=False)
    result = run_overlap(tiny_engine, options, tmp_path)  # raises if a chunk was recomputed
    assert (result.chunks, result.chunk_tokens, len(result.samples)) == (2, 48, 1)
    sample = result.samples[0]
    layers_in_store = options.chunks * tiny_engine.loaded.spec.num_layers
    assert (
        0 < sample["layers_read"]
        and sample["layers_read"] + sample["layers_wasted"] <= layers_in_store
    )
    assert (result.load_s, result.wait_s) == (sample["load_s"], sample["wait_s"])
    assert result.load_s > 0 and result.wait_s >= 0
    assert (
        result.hidden_share == sample["hidden_share"] == hidden_share(result.load_s, result.wait_s)
    )
    assert result.ttft_cold_disk_s > 0 and result.ttft_in_memory_s > 0
