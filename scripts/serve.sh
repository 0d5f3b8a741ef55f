#!/usr/bin/env bash
# Set up (idempotent), ingest the shipped demo corpus (idempotent: already-ingested articles
# are skipped), then run the server; it prints the URL to open when it is ready.
# Settings come from KVMOSAIC_* variables (`kvmosaic settings`, docs/configuration.md); extra arguments go to `kvmosaic serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/kvmosaic ingest app/demo_corpus
exec .venv/bin/kvmosaic serve "$@"
