"""A start that cannot succeed (#59 item 5) prints one line naming the file or setting and the
fix, and changes nothing: a damaged catalog, a truncated converted model, a missing CUDA device,
a data directory that cannot exist. `kvmosaic serve` runs; uvicorn never starts."""

from __future__ import annotations

import os
import shutil

import pytest

from app.cli import main

# a safetensors header that promises more than the file holds (a copy cut short)
TRUNCATED = (200).to_bytes(8, "little") + b'{"__metadata__": {"format": "pt"}'


@pytest.fixture(autouse=True)
def no_server(monkeypatch):
    """The start must fail before uvicorn; if it does not, fail instead of serving."""

    def never(self, *args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr("uvicorn.Server.run", never)
    for name in [n for n in os.environ if n.startswith("KVMOSAIC_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def tiny_engine_load(monkeypatch, tiny_loaded, embedder):
    """`Services.start` loads the tiny model and the session's embedder (no real weights)."""
    import app.services
    from engine.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, config: cls(config, tiny_loaded)))
    monkeypatch.setattr(app.services, "Embedder", lambda *args, **kwargs: embedder)


def serve_error(capsys, *argv: str) -> str:
    """The one line `kvmosaic serve` fails with (asserting there is one, and no traceback)."""
    assert main(["serve", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def snapshot(folder) -> dict[str, bytes]:
    """The files under `folder` and their bytes (the catalog's empty migration lock aside)."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".lock"]
    return {str(p): p.read_bytes() for p in files}


def test_a_damaged_catalog_is_named_with_its_fix(tmp_path, capsys, tiny_engine_load):
    catalog = tmp_path / "catalog.db"
    catalog.write_bytes(b"this is not a database " * 200)
    before = snapshot(tmp_path)
    line = serve_error(capsys, "--data-dir", str(tmp_path))
    assert str(catalog) in line and "not a SQLite database" in line, line
    assert "restore it from a backup" in line
    assert snapshot(tmp_path) == before


def test_a_truncated_converted_model_is_named_with_its_fix(tmp_path, capsys, smol_checkpoint):
    from engine.model.known import SMOLLM2, checkpoint_dir

    converted = checkpoint_dir(tmp_path, SMOLLM2)
    shutil.copytree(smol_checkpoint, converted, ignore=shutil.ignore_patterns("*.safetensors"))
    (converted / "model.safetensors").write_bytes(TRUNCATED)
    before = snapshot(tmp_path)
    line = serve_error(capsys, "--data-dir", str(tmp_path))
    assert str(converted / "model.safetensors") in line, line
    assert f"delete {converted} to convert it again" in line
    assert snapshot(tmp_path) == before


def test_a_truncated_checkpoint_by_path_is_named(tmp_path, capsys, smol_checkpoint, monkeypatch):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(smol_checkpoint, checkpoint, ignore=shutil.ignore_patterns("*.safetensors"))
    (checkpoint / "model.safetensors").write_bytes(TRUNCATED)
    monkeypatch.setenv("KVMOSAIC_MODEL_PATH", str(checkpoint))
    line = serve_error(capsys, "--data-dir", str(tmp_path / "data"))
    assert str(checkpoint / "model.safetensors") in line and "restore the checkpoint" in line


def test_a_data_dir_that_cannot_exist_is_named(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    line = serve_error(capsys, "--data-dir", str(blocker / "data"))
    assert f"KVMOSAIC_DATA_DIR={blocker / 'data'}: cannot create it" in line, line


def test_cuda_without_a_cuda_device_is_named(tmp_path, capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    monkeypatch.setenv("KVMOSAIC_DEVICE", "cuda")
    line = serve_error(capsys, "--data-dir", str(tmp_path))
    assert line.startswith("kvmosaic: KVMOSAIC_DEVICE=cuda: no CUDA device"), line


def test_an_unknown_device_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVMOSAIC_DEVICE", "tpu")
    line = serve_error(capsys, "--data-dir", str(tmp_path))
    assert "KVMOSAIC_DEVICE='tpu'" in line and "cpu, cuda or cuda:N" in line
