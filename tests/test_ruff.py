"""The tree is formatted by `ruff format` and lints clean under ruff (pyproject.toml
[tool.ruff]: pyflakes, line length 100, isort import order, bugbear, pyupgrade), except the files
of `NOT_YET_CLEAN`.

`NOT_YET_CLEAN` is a list that only shrinks: a file that passes must leave it (a test says so),
and a file not on it must stay clean. Its counts are the findings when the linter came in, for
whoever cleans the file. `.venv/bin/ruff check .` shows everything; `ruff check
--fix` fixes import order and most pyupgrade findings by itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from tests.test_layout import REPO

# {file: findings} when the linter was introduced; the owners of these files clean them.
NOT_YET_CLEAN: dict[str, int] = {}


def findings() -> Counter[str]:
    """Findings per file (paths relative to the repo)."""
    # the committed tree's files (a file being written, not yet added, is not judged)
    tracked = subprocess.run(
        ["git", "ls-files", "--", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    command = [
        sys.executable,
        "-m",
        "ruff",
        "check",
        "--output-format",
        "json",
        "--exit-zero",
        "--force-exclude",
        *(name for name in tracked if (REPO / name).exists()),
    ]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    names = (str(item["filename"]).removeprefix(f"{REPO}/") for item in json.loads(run.stdout))
    return Counter(names)


@pytest.fixture(scope="module")
def found() -> Counter[str]:
    if subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode:
        pytest.skip("ruff is not installed: run scripts/setup.sh (the dev extra has it)")
    return findings()


def test_files_outside_the_list_are_clean(found):
    dirty = {name: count for name, count in found.items() if name not in NOT_YET_CLEAN}
    assert not dirty, f"ruff findings (`.venv/bin/ruff check {' '.join(sorted(dirty))}`): {dirty}"


def test_the_list_only_names_files_that_still_need_it(found):
    clean = sorted(name for name in NOT_YET_CLEAN if found[name] == 0 and (REPO / name).exists())
    assert not clean, f"clean now, remove from NOT_YET_CLEAN: {clean}"


def test_the_tree_is_formatted():
    """`ruff format` was applied once to every file; a change that leaves a file unformatted
    fails here (`.venv/bin/ruff format .` mends it)."""
    if subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode:
        pytest.skip("ruff is not installed: run scripts/setup.sh (the dev extra has it)")
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"`.venv/bin/ruff format .` would change:\n{run.stdout[-2000:]}"
