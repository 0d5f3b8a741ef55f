"""MiniLM embeddings load offline, are unit length, and rank a paraphrase above an unrelated
text."""

from __future__ import annotations

import numpy as np
import pytest

from retrieval.embedder import Embedder


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def test_vectors_are_normalised(embedder):
    vectors = embedder.encode(["The harbour freezes in winter.", "Bees make honey."])
    assert vectors.shape == (2, embedder.dim) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_paraphrase_is_closer_than_unrelated_text(embedder):
    query, near, far = embedder.encode(
        [
            "When does the port freeze?",
            "The harbour freezes in winter.",
            "Bees make honey from nectar.",
        ]
    )
    assert query @ near > query @ far + 0.2


def test_no_texts_and_stable_name(embedder):
    assert embedder.encode([]).shape == (0, embedder.dim)
    assert embedder.name == Embedder(embedder.model_path).name


def test_the_linear_kernel_changes_vectors_only_by_rounding_and_keeps_the_name(embedder):
    """An index built under one kernel stays valid under the other (engine/model/linear.py)."""
    import torch

    from engine.model.linear import linear_kernel_of, onednn_agrees

    if not onednn_agrees(torch.float32):
        pytest.skip("this PyTorch build has no oneDNN linear")
    on_onednn = Embedder(embedder.model_path, linear_kernel="onednn")
    on_torch = Embedder(embedder.model_path, linear_kernel="torch")
    assert (on_onednn.linear_kernel, on_torch.linear_kernel) == ("onednn", "torch")
    assert (
        linear_kernel_of(on_onednn.model) == "onednn"
        and linear_kernel_of(on_torch.model) == "torch"
    )
    texts = ["The harbour freezes in winter.", "Bees make honey from nectar."]
    assert np.allclose(on_onednn.encode(texts), on_torch.encode(texts), atol=1e-5)
    assert on_torch.name == on_onednn.name == embedder.name


def test_a_view_runs_its_encodings_through_the_given_runner(embedder):
    import threading

    ran_on = []

    def runner(fn):
        ran_on.append(threading.current_thread())
        box = []
        thread = threading.Thread(target=lambda: box.append(fn()))
        thread.start()
        thread.join()
        return box[0]

    view = embedder.running_on(runner)
    texts = ["The tide mill ground grain.", "Bees dance."]
    assert view.name == embedder.name and view.dim == embedder.dim
    assert np.array_equal(view.encode(texts), embedder.encode(texts))
    assert len(ran_on) == 1  # the view's encode went through the runner; the original's did not
    assert view.encode([]).shape == (0, embedder.dim)  # nothing to run for no texts
    assert len(ran_on) == 1
    many = [
        f"Passage number {i} about tide mills and bees." for i in range(2 * embedder.batch_size + 3)
    ]
    assert np.allclose(view.encode(many), embedder.encode(many), atol=1e-5)
    assert len(ran_on) == 1 + 3  # one batch per call: the runner is never held for a whole document
