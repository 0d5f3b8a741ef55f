#!/usr/bin/env bash
# GPU check of the CUDA kernels (engine/csrc) on a lent GPU machine, in one call.
#
# 1. Here (a machine with the project's .venv), stage what the GPU machine cannot reach:
#        bash scripts/device_check.sh stage
#    It fills .device-stage/ (git-ignored, ~26 MB): the first MuSiQue records, the
#    embedded SmolLM2's config and tokenizer, and wheels of the packages `app.cli` imports
#    that the GPU image lacks (pydantic and its kin, redis, opentelemetry-api, faiss-cpu;
#    `WHEELS`), in this .venv's versions, for the image's Python 3.12. The weights (0.5 GB as
#    safetensors, 98 MB as GGUF) exceed what one device call may carry (64 MiB), so there the
#    model gets random weights of the same shape: TTFT is then meaningful, KL / top-1 /
#    ROUGE-L are not.
#    Set KVMOSAIC_MODEL_PATH there to a real checkpoint to measure fidelity too.
# 2. There, with the device tool:
#        run(command="bash scripts/device_check.sh", carry=[".device-stage"], timeout_s=540)
#
# Assumes the GPU machine's python3 has a CUDA torch, transformers, accelerate, safetensors,
# tokenizers, tqdm and pytest, and nvcc on PATH (the nvidia-h200 image has all of them);
# the staged wheels are installed into /tmp (nothing is downloaded there). Results go to $OUT
# (at most 8 files come back):
#   summary.txt (environment, step results, both tables), build.log, gpu-tests.log,
#   kernels.json, fidelity.log, fidelity.json, fidelity-twins.json.
# Steps: build the kernels -> gpu tests -> kernel timings vs PyTorch eager ->
#   `kvmosaic bench fidelity` full vs cacheblend@fast in fp16 (at `balanced` random weights
#   tie so often that every request re-runs in full), with the kernels and with the twins
#   (KVMOSAIC_KERNELS=off), so the TTFT ratio shows what the kernels add.
# A dry run of the script's plumbing on a CPU machine (no GPU numbers, nothing meaningful):
#   PYTHON=.venv/bin/python DEVICE=cpu DTYPE=float32 RECORDS=1 bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

STAGE=.device-stage
RECORDS=${RECORDS:-5}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-float16}

# packages app.cli imports that the GPU image lacks (its KINDS.md list), staged as wheels
WHEELS=(pydantic pydantic_core annotated-types typing-inspection pydantic-settings python-dotenv
        redis hiredis opentelemetry-api typing_extensions faiss-cpu)

stage_wheels() {
  local pins=() name version
  for name in "${WHEELS[@]}"; do
    version=$(.venv/bin/python -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name") || return 1
    pins+=("$name==$version")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d $STAGE/wheels "${pins[@]}"
}

stage() {
  local venv=.venv/bin/python
  mkdir -p $STAGE/model
  stage_wheels || exit 1
  local checkpoint
  checkpoint=$($venv -c "from pathlib import Path; from engine.model.loader import embedded_checkpoint
print(embedded_checkpoint(Path('.cache/test-data')))") || exit 1
  cp "$checkpoint"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} $STAGE/model/
  cp "$checkpoint"/chat_template.jinja $STAGE/model/ 2>/dev/null || true
  $venv -c "import json, sys; records = json.load(open(sys.argv[1]))[:int(sys.argv[3])]
json.dump(records, open(sys.argv[2], 'w'))" ../shared/data/cacheblend/musique_s.json $STAGE/musique_head.json \
    "$((RECORDS + 1))" || exit 1
  du -sh $STAGE
}

if [ "${1:-}" = "stage" ]; then
  stage
  exit 0
fi

OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d $STAGE/wheels ] && ! $PY -c "import pydantic" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvmosaic-site \
    $STAGE/wheels/*.whl && export PYTHONPATH=/tmp/kvmosaic-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVMOSAIC_KERNEL_CACHE=/tmp/kvmosaic-kernels
SUMMARY=$OUT/summary.txt
KVMOSAIC=("$PY" -c 'import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))')
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME LOG SECONDS COMMAND...: run with a time limit, record the outcome
  local name=$1 log=$2 limit=$3 started=$SECONDS rc
  shift 3
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  note "step $name: exit $rc in $((SECONDS - started)) s (log $(basename "$log"))"
  return $rc
}

environment() {
  note "== environment"
  { nvidia-smi -L; nvcc --version | tail -1
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '');
print('transformers', transformers.__version__)"
    $PY -c "import engine.engine, bench.fidelity.fidelity, app.cli" && echo "imports: ok"
  } 2>&1 | tee -a "$SUMMARY"
}

# The model for the fidelity bench: KVMOSAIC_MODEL_PATH, else the staged config and tokenizer
# with random fp16 weights (TTFT only).
fidelity_model() {
  if [ -n "${KVMOSAIC_MODEL_PATH:-}" ]; then echo "$KVMOSAIC_MODEL_PATH"; return; fi
  local target=/tmp/kvmosaic-random-smollm2
  [ -f $target/model.safetensors ] || $PY - "$STAGE/model" $target <<'EOF' >&2
import shutil, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
source, target = sys.argv[1:3]
shutil.copytree(source, target, dirs_exist_ok=True)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float16)  # saved in fp16
model.save_pretrained(target)
print("random-weight model of", source, "in", target)
EOF
  echo $target
}

environment
note "== build"
step build "$OUT/build.log" 300 $PY -m engine.kernels && note "library: $(tail -1 "$OUT/build.log")"

note "== gpu tests (kernels against their twins, outputs poisoned)"
KVMOSAIC_KERNELS=require step gpu-tests "$OUT/gpu-tests.log" 240 \
  $PY -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_kernels.py
tail -3 "$OUT/gpu-tests.log" | tee -a "$SUMMARY"

note "== kernel timings (speedup = PyTorch eager twin time / kernel time)"
KVMOSAIC_KERNELS=require step kernels "$OUT/kernels.log" 180 \
  "${KVMOSAIC[@]}" bench kernels --device "$DEVICE" --dtype "$DTYPE" --json "$OUT/kernels.json"
cat "$OUT/kernels.log" >>"$SUMMARY"
rm -f "$OUT/kernels.log"

note "== fidelity (TTFT ratio = full / mode; random weights unless KVMOSAIC_MODEL_PATH is set)"
DATASET=../shared/data/cacheblend/musique_s.json
[ -f "$DATASET" ] || DATASET=$STAGE/musique_head.json
MODEL=$(fidelity_model 2>>"$OUT/fidelity.log")
note "model $MODEL, dataset $DATASET"
FIDELITY=("${KVMOSAIC[@]}" bench fidelity --device "$DEVICE" --dtype "$DTYPE" --n "$RECORDS" --modes full,cacheblend@fast
          --model "$MODEL" --dataset "$DATASET" --data-dir /tmp/kvmosaic-data)
for kernels in require off; do  # off: the PyTorch twins, to see what the kernels add to TTFT
  name=fidelity$([ $kernels = off ] && echo -twins)
  KVMOSAIC_KERNELS=$kernels step $name "$OUT/part.log" 240 "${FIDELITY[@]}" --json "$OUT/$name.json"
  cat "$OUT/part.log" >>"$OUT/fidelity.log"
  grep -v "it/s\|s/it" "$OUT/part.log" | tail -6 >>"$SUMMARY"
done
rm -f "$OUT/part.log"
note "== done"
