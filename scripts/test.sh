#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest (after ours,
# so `-n 0` runs in this process). Tests run in AUGURY_TEST_WORKERS processes (pytest-xdist,
# default 2): each runs torch on one thread, so two use both cores of a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${AUGURY_VENV:-.venv}/bin/python" -m pytest -n "${AUGURY_TEST_WORKERS:-2}" "$@"
