#!/usr/bin/env bash
# Set up (if needed), then run every service in one process: the OpenAI-compatible gateway on
# 127.0.0.1:8000 (AUGURY_GATEWAY__HOST/PORT), scheduler, verifier and one drafter per draft model,
# all talking through Redis (an embedded redis-server unless AUGURY_REDIS__URL is set).
# Extra arguments go to `python -m services all`, e.g. --drafts draft-s --threads 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${AUGURY_VENV:-.venv}/bin/python" -m services all "$@"
