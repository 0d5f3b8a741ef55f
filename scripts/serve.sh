#!/usr/bin/env bash
# Set up (idempotent) and answer a demo question from the command line with the embedded model.
# (Replaced by "ingest the demo corpus and start the server" once the server exists.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/kvmosaic bench fidelity --dataset "${KVMOSAIC_DEMO_DATASET:-../shared/data/cacheblend/musique_s.json}" --n 1 "$@"
