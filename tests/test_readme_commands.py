"""The README's first command runs as written (with a small output): `scripts/generate.sh` sets
up what is missing and streams a speculative completion. The other commands of the README and
the reference pages are checked statically by tests/test_doc_commands.py; those of
docs/load-testing.md run in tests/test_replay.py."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tools.doc_extract import fenced_lines

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.smollm2


def readme_generate_command() -> list[str]:
    for line in fenced_lines((ROOT / "README.md").read_text()):
        if line.startswith("bash scripts/generate.sh"):
            return shlex.split(line)
    raise AssertionError("the README shows no scripts/generate.sh command")


def test_the_readmes_first_command_streams_a_completion() -> None:
    command = [*readme_generate_command(), "--max-tokens", "8", "--threads", "1"]
    env = {**os.environ, "AUGURY_VENV": os.environ.get("AUGURY_VENV", ".venv")}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "generated tokens" in done.stdout and "mean accepted length" in done.stdout
