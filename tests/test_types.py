"""The request path type-checks strictly: `mypy` with the project's config (pyproject.toml
[tool.mypy]: strict, the request path from retrieval to decode and everything it imports)."""

from __future__ import annotations

import subprocess
import sys

from tests.test_layout import REPO


def test_the_request_path_is_clean_under_mypy_strict(tmp_path):
    # a private cache: a stale shared one cannot hide an error, and runs in parallel do not collide
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Success: no issues found" in run.stdout


def test_mypy_would_catch_a_wrong_type(tmp_path):
    # the check above must be able to fail: the same config on a file with a type error
    bad = tmp_path / "bad.py"
    bad.write_text("from engine.kv import ChunkId\n\n\ndef chunk() -> ChunkId:\n    return 'c1'\n")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 1 and "Incompatible return value type" in run.stdout
