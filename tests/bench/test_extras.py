"""The benchmarks' own dependencies are the `bench` extra: a server install lacks them, and a
benchmark that needs one says what to install instead of failing inside its run."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import bench.extras
from bench.extras import BENCH_EXTRAS, MissingBenchExtra, require

REPO = Path(__file__).resolve().parents[2]


def _without(monkeypatch, missing: str) -> None:
    real = bench.extras.find_spec
    monkeypatch.setattr(
        bench.extras, "find_spec", lambda name: None if name == missing else real(name)
    )


def test_a_server_install_carries_no_benchmark_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    extra = " ".join(project["optional-dependencies"]["bench"])
    for module in BENCH_EXTRAS:
        assert module not in runtime and module in extra
    assert '".[dev,bench]"' in (REPO / "scripts/setup.sh").read_text()


def test_a_missing_extra_names_the_install_command(monkeypatch):
    _without(monkeypatch, "matplotlib")
    with pytest.raises(MissingBenchExtra, match=r"pip install 'kvmosaic\[bench\]'"):
        require("matplotlib")


def test_an_installed_extra_passes_quietly():
    require("matplotlib")  # scripts/setup.sh installs the extra


def test_workload_report_without_matplotlib_fails_before_the_run(monkeypatch, tmp_path, capsys):
    from app.cli import main
    from engine.engine import Engine

    _without(monkeypatch, "matplotlib")

    def no_load(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(Engine, "load", no_load)
    assert main(["bench", "workload", "--report", str(tmp_path / "r")]) == 1
    assert "kvmosaic[bench]" in capsys.readouterr().err
