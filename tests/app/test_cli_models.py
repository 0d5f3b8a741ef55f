"""`kvmosaic models` and the model settings: `KVMOSAIC_MODEL`, `--model` / `--model-path`."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from app.cli import main
from app.cli.common import add_engine_arguments, settings_overrides
from app.settings import Settings
from engine import EngineConfig
from engine.model.known import QWEN_CODER, SMOLLM2, ModelNotInstalled, checkpoint_dir, checkpoint_of


@pytest.fixture
def clean_model_env(monkeypatch):
    for name in ("KVMOSAIC_MODEL", "KVMOSAIC_MODEL_PATH", "KVMOSAIC_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)


def fake_install(data_dir, size: int = 3000):
    """A finished pull's folder (what `models` looks at), with `size` bytes of weights."""
    target = checkpoint_dir(data_dir, QWEN_CODER)
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"\0" * size)
    return target


def test_models_lists_every_known_model_with_its_state_size_and_place(
    clean_model_env, tmp_path, capsys
):
    assert main(["models", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    smol, qwen = (
        next(line for line in out.splitlines() if line.startswith(name))
        for name in (SMOLLM2.name, QWEN_CODER.name)
    )
    assert smol.startswith(f"{SMOLLM2.name} *")  # selected by default
    assert "not installed" in qwen and f"kvmosaic models pull {QWEN_CODER.name}" in qwen
    target = fake_install(tmp_path, size=2_600_000)
    assert main(["models", "--data-dir", str(tmp_path)]) == 0
    qwen = next(line for line in capsys.readouterr().out.splitlines() if "qwen" in line)
    assert "installed" in qwen and "not installed" not in qwen
    assert "3 MB" in qwen and str(target) in qwen


def test_pulling_an_installed_model_says_so_and_does_nothing(clean_model_env, tmp_path, capsys):
    target = fake_install(tmp_path)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert main(["models", "pull", QWEN_CODER.name, "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "already installed" in out and "nothing to do" in out and str(target) in out
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(SystemExit):  # only known names
        main(["models", "pull", "llama-70b", "--data-dir", str(tmp_path)])


def test_a_known_model_that_is_not_installed_says_how_to_pull_it(tmp_path):
    with pytest.raises(ModelNotInstalled) as refused:
        checkpoint_of(tmp_path, QWEN_CODER.name, None)
    assert f"run `kvmosaic models pull {QWEN_CODER.name}`" in str(refused.value)
    assert str(tmp_path / "models") in str(refused.value)


def test_kvmosaic_model_selects_by_name_and_refuses_unknown_names_and_both(
    clean_model_env, monkeypatch
):
    monkeypatch.setenv("KVMOSAIC_MODEL", QWEN_CODER.name)
    assert Settings().engine_config().model == QWEN_CODER.name
    monkeypatch.setenv("KVMOSAIC_MODEL", "qwen-72b")
    with pytest.raises(ValidationError, match="kvmosaic knows smollm2-135m, qwen2.5-coder-0.5b"):
        Settings()
    monkeypatch.setenv("KVMOSAIC_MODEL", QWEN_CODER.name)
    monkeypatch.setenv("KVMOSAIC_MODEL_PATH", "/models/qwen")
    with pytest.raises(ValidationError, match="set either a model by name or a checkpoint"):
        Settings()
    monkeypatch.setenv("KVMOSAIC_MODEL", "")  # blank is unset
    assert Settings().model is None and Settings().model_path == "/models/qwen"
    with pytest.raises(ValueError, match="both set"):
        EngineConfig(model=QWEN_CODER.name, model_path="/models/qwen")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_the_model_flags_replace_both_variables(clean_model_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVMOSAIC_MODEL_PATH", "/models/env")
    by_name = Settings(**settings_overrides(parse("--model", QWEN_CODER.name)))
    assert (by_name.model, by_name.model_path) == (QWEN_CODER.name, None)
    by_path = Settings(**settings_overrides(parse("--model-path", "/models/flag")))
    assert (by_path.model, by_path.model_path) == (None, "/models/flag")
    # --model still takes a path, as before names existed
    old_style = Settings(**settings_overrides(parse("--model", str(tmp_path))))
    assert (old_style.model, old_style.model_path) == (None, str(tmp_path))
    assert settings_overrides(parse()) == {}
    with pytest.raises(SystemExit):
        parse("--model", "no-such-model-or-path")
    assert "neither a known model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--model", QWEN_CODER.name, "--model-path", str(tmp_path))
    assert "not allowed with" in capsys.readouterr().err
