#!/usr/bin/env bash
# Set up (if needed), then stream a completion with speculative decoding on the default models.
#   bash scripts/generate.sh "Write a haiku about caches." --method dynamic
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${AUGURY_VENV:-.venv}/bin/python" -m shared.cli generate "$@"
