"""GGUF files (engine/model/gguf.py): the header read without tensors, a local `.gguf` given as
the model path (converted once, found again by content), and refusals before any conversion."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.errors import KvMosaicError, UnsupportedModel
from engine.model import gguf as gguf_module
from engine.model.gguf import read_header
from engine.model.loader import load_model
from tests.engine.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", layers=3)


def test_the_header_is_read_without_the_tensors(tiny_file):
    import gguf

    header = read_header(tiny_file)
    reader = gguf.GGUFReader(str(tiny_file))  # the package's own reader, which maps everything
    assert header.architecture == "qwen2" and header.num_layers == 3
    assert header.name == "tiny qwen2" and header.version == 3
    assert header.num_elements == sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert header.metadata["qwen2.attention.head_count_kv"] == 2
    assert "tokenizer.ggml.tokens" not in header.metadata  # arrays are skipped


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(KvMosaicError, match="not a GGUF file"):
        read_header(fake)
    fake.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    with pytest.raises(KvMosaicError, match="cut short"):
        read_header(fake)


def test_a_local_gguf_converts_once_and_is_found_again_by_its_content(
    tiny_file, tmp_path, monkeypatch
):
    data_dir = tmp_path / "data"
    loaded = load_model(data_dir, str(tiny_file), "cpu", "float32")
    assert loaded.spec.num_layers == 3 and loaded.model.config.model_type == "qwen2"
    assert loaded.tokenizer.chat_template and "<|im_start|>" in loaded.tokenizer.chat_template
    converted = [p for p in (data_dir / "models").iterdir() if p.name.startswith("gguf-")]
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    # the same bytes under another name: no second conversion, the same model
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_file, copy)

    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_module, "convert_gguf", refuse)
    again = load_model(data_dir, str(copy), "cpu", "float32")
    assert again.fingerprint == loaded.fingerprint
    # the converted folder, given as a path, is the same model too
    assert load_model(data_dir, str(converted[0]), "cpu", "float32").fingerprint == (
        loaded.fingerprint
    )
    # other content converts into its own folder
    monkeypatch.undo()
    other = write_tiny_gguf(tmp_path / "other.gguf", layers=3, seed=1)
    assert load_model(data_dir, str(other), "cpu", "float32").fingerprint != loaded.fingerprint
    assert len([p for p in (data_dir / "models").iterdir() if p.name.startswith("gguf-")]) == 2


@pytest.mark.parametrize(
    "arch, extra, message",
    [
        ("gemma3", None, "model type 'gemma3_text' is not supported: Gemma 3 alternates"),
        ("llama", {"expert_count": 8}, "model type 'mixtral' is not supported: its MLP is a"),
        ("qwen2moe", {"expert_count": 4}, "model type 'qwen2_moe' is not supported"),
        ("phi3", None, "model type 'phi3' is not supported"),
    ],
)
def test_an_unsupported_architecture_is_refused_before_any_tensor_is_converted(
    tmp_path, monkeypatch, arch, extra, message
):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, extra=extra)

    def refuse(*args, **kwargs):
        raise AssertionError("converted an unsupported model")

    monkeypatch.setattr(gguf_module, "convert_gguf", refuse)
    monkeypatch.setattr(gguf_module, "file_sha256", refuse)  # refused before it is even hashed
    with pytest.raises(UnsupportedModel, match=message):
        load_model(tmp_path / "data", str(path), "cpu", "float32")
    models = tmp_path / "data" / "models"
    assert not models.exists() or not [p for p in models.iterdir() if p.is_dir()]


def test_a_missing_gguf_path_is_refused(tmp_path):
    with pytest.raises(KvMosaicError, match="is not a file"):
        load_model(tmp_path, str(tmp_path / "absent.gguf"), "cpu", "float32")
