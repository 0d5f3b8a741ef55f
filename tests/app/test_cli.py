"""`kvmosaic ingest` and `kvmosaic ask` (in-process) on the tiny model; `serve` is in
test_e2e_serve."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from app.services import Services
from tests.app.conftest import start_services


@pytest.fixture
def tiny_start(tiny_loaded, embedder, tmp_path, monkeypatch):
    """Make `Services.start` build the tiny-model services (in one data dir across calls)."""
    real = Services.start

    def start(cls, settings, engine=None, embedder_=None):
        monkeypatch.setattr(Services, "start", real)
        try:
            return start_services(tiny_loaded, embedder, tmp_path, docs=[])
        finally:
            monkeypatch.setattr(Services, "start", classmethod(start))

    monkeypatch.setattr(Services, "start", classmethod(start))


def test_ingest_is_idempotent_and_reports_failures(tiny_start, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.md").write_text("# Tides\n\nSpring tides follow the full and new moon.")
    (corpus / "b.txt").write_text("Neap tides come at the quarter moons.")
    assert main(["ingest", "--quiet", str(corpus)]) == 0
    assert "ingested 2 new documents (2 chunks" in capsys.readouterr().out
    assert main(["ingest", "--quiet", str(corpus)]) == 0
    out = capsys.readouterr().out
    assert "ingested 0 new documents" in out and "2 already present" in out


def test_ingest_kv_lazy_indexes_without_kv_and_reports_tokens_per_second(
    tiny_start, tmp_path, capsys
):
    (tmp_path / "lazy.md").write_text("# Herons\n\nEleven herons fish the mill pond at dawn.")
    assert main(["ingest", "--kv", "lazy", str(tmp_path / "lazy.md")]) == 0
    captured = capsys.readouterr()
    assert "ingested 1 new documents" in captured.out and "KV lazy" in captured.out
    assert (
        "tokens/s" in captured.out and "tok/s" in captured.err
    )  # the summary and the progress bar
    with pytest.raises(SystemExit):
        main(["ingest", "--kv", "later", str(tmp_path / "lazy.md")])


def test_ingest_refuses_an_unreadable_path_before_writing(tiny_start, tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    assert main(["ingest", str(bad)]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_ask_prints_the_answer_and_a_report(tiny_start, tmp_path, capsys):
    (tmp_path / "mill.md").write_text(
        "# Saltcote Tide Mill\n\nThe mill was built in 1734 and restored in 2006."
    )
    main(["ingest", "--quiet", str(tmp_path / "mill.md")])
    capsys.readouterr()
    assert main(["ask", "When was the mill built?", "--max-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["chunks"][0]["document"] == "Saltcote Tide Mill" and report["mode"] == "cacheblend"
    )
    assert main(["ask", "When was the mill built?", "--max-tokens", "4", "--mode", "naive"]) == 0
    out = capsys.readouterr().out
    assert "mode naive: TTFT" in out and "Saltcote Tide Mill" in out
    assert main(["ask", "When?", "--mode", "turbo"]) == 2
    assert "unknown mode 'turbo'" in capsys.readouterr().err


def test_the_benchmark_commands_come_in_as_plugins(capsys):
    """`kvmosaic bench` and `calibrate` are entry points of `bench/`, not imports of the
    product; both are listed while `bench/` is installed."""
    from app.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"bench", "calibrate", "serve", "ask"} <= set(commands)


def test_a_missing_plugin_leaves_the_product_commands(monkeypatch):
    """An install without `bench/` (the Docker image) still has every product command."""
    from importlib.metadata import EntryPoint

    import app.cli as cli

    missing = EntryPoint("bench", "no_such_package.cli:add_parser", cli.PLUGIN_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda group: [missing])
    commands = cli.build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == {"serve", "ingest", "condition", "ask", "settings", "models"}


def test_condition_computes_the_missing_conditioned_bases_once(
    tiny_start, tmp_path, capsys, monkeypatch
):
    for name, text in (
        ("a.md", "# Tides\n\nSpring tides follow the full and new moon."),
        ("b.md", "# Neaps\n\nNeap tides come at the quarter moons."),
    ):
        (tmp_path / name).write_text(text)
        assert main(["ingest", "--quiet", "--kv", "lazy", str(tmp_path / name)]) == 0
    assert main(["condition", "--quiet"]) == 2  # conditioning is off
    assert "KVMOSAIC_CONDITIONED_NEIGHBOURS" in capsys.readouterr().err
    monkeypatch.setenv("KVMOSAIC_CONDITIONED_NEIGHBOURS", "1")
    monkeypatch.setenv("KVMOSAIC_CONDITIONED_LEAD_TOKENS", "4")
    assert main(["condition"]) == 0
    captured = capsys.readouterr()
    assert "(1 neighbours, 4 lead tokens each): 2 computed, 0 already there" in captured.out
    assert "tok/s" in captured.err  # the progress bar
    assert main(["condition", "--quiet"]) == 0
    assert ": 0 computed, 2 already there" in capsys.readouterr().out
    assert main(["condition", "--quiet", "--all"]) == 0
    assert ": 2 computed, 0 already there" in capsys.readouterr().out
