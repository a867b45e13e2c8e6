"""List, and optionally run, every command the README and the reference docs show.

    python -m tools.doc_commands                    # list them, with what a smoke run would do
    python -m tools.doc_commands --run              # run each as written (hours: the benchmarks)
    python -m tools.doc_commands --smoke --match traces   # small sizes; skips what cannot run here

Each command runs in a scratch copy of the repository's files (the virtual environment and
models/ linked in), `python` being this interpreter, with a per-command timeout; a script that
sets up first (`bash scripts/generate.sh ...`) runs as the module it calls after its set-up.
Exit status 1 if any command failed or timed out."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.doc_extract import PYTHON, ROOT, commands, problems_of
from tools.doc_smoke import shrink, skip_reason, unsafe_reason

LINKED = (".venv", "models")  # ignored by git, large, and read by the commands


@dataclass(frozen=True)
class Command:
    doc: str
    line: str


def documented_commands(match: str | None = None) -> list[Command]:
    """The repository's commands (`python -m` of its packages, `bash scripts/...`) in doc order,
    each once, those containing `match` if given."""
    seen: set[str] = set()
    found = []
    for doc, line in commands():
        if problems_of(line) is None or line in seen or (match and match not in line):
            continue
        seen.add(line)
        found.append(Command(doc, line))
    return found


def as_run(line: str) -> str:
    """The line with its python (`python`, `.venv/bin/python`) as this interpreter, and a script
    that first sets up (scripts/setup.sh: a venv, pip installs) as the module it then runs:
    run from a scratch copy, the set-up would install this copy into the environment."""
    words = shlex.split(line)
    if words and PYTHON.match(words[0]):
        words[0] = sys.executable
    elif len(words) >= 2 and words[0] == "bash" and (call := _call_after_setup(ROOT / words[1])):
        words = [sys.executable, *call, *words[2:]]
    return shlex.join(words)


def _call_after_setup(script: Path) -> list[str] | None:
    """`-m module [fixed args]` a script runs with its own arguments after scripts/setup.sh."""
    text = script.read_text() if script.is_file() else ""
    found = re.search(r'-m\s+([\w.]+)((?:\s+[\w-]+)*)\s+"\$@"', text)
    if "scripts/setup.sh" not in text or found is None:
        return None
    return ["-m", found.group(1), *found.group(2).split()]


def scratch_copy(into: Path) -> Path:
    """The repository's tracked and unignored files copied under `into`, `LINKED` linked."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    copy = into / "repo"
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    for name in LINKED:
        _link_missing(ROOT / name, copy / name)
    return copy


def _link_missing(source: Path, target: Path) -> None:
    """`target` a link to `source`; where `target` is a copied folder, its missing entries."""
    if not source.exists():
        return
    if not target.is_dir():
        target.symlink_to(source)
        return
    for entry in source.iterdir():
        if not (target / entry.name).exists():
            (target / entry.name).symlink_to(entry)


def run_one(line: str, cwd: Path, timeout_s: float) -> tuple[str, float, str]:
    """(pass | fail | timeout, seconds, the output's tail) of one command, its process group
    killed at the timeout."""
    started = time.monotonic()
    process = subprocess.Popen(
        line,
        shell=True,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
        status = "pass" if process.returncode == 0 else "fail"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = "timeout"
    tail = output.decode(errors="replace")[-2000:]
    return status, time.monotonic() - started, tail


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    found = documented_commands(args.match)
    if not (args.run or args.smoke):
        for command in found:
            reason = skip_reason(command.line)
            note = f"smoke: skip ({reason})" if reason else f"smoke: {shrink(command.line)}"
            print(f"{command.doc}: {command.line}\n    {note}")
        print(f"{len(found)} commands")
        return 0
    counts = {"pass": 0, "fail": 0, "timeout": 0, "skip": 0}
    with tempfile.TemporaryDirectory(prefix="doc-commands-") as scratch:
        cwd = scratch_copy(Path(scratch))
        for command in found:
            line = command.line
            reason = skip_reason(line) if args.smoke else unsafe_reason(line)
            if reason is not None:
                counts["skip"] += 1
                print(f"skip     {command.doc}: {line}  ({reason})", flush=True)
                continue
            if args.smoke:
                line = shrink(line)
            status, seconds, tail = run_one(as_run(line), cwd, args.timeout)
            counts[status] += 1
            print(f"{status:<8} {command.doc}: {line}  [{seconds:.0f} s]", flush=True)
            if status != "pass":
                print("    " + tail.replace("\n", "\n    "), flush=True)
    print(", ".join(f"{n} {status}" for status, n in counts.items()))
    return 1 if counts["fail"] or counts["timeout"] else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.doc_commands",
        description="List, or run, the commands of the README and docs/*.md.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--run", action="store_true", help="run every command as written")
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="run with small sizes; skip what installs, downloads, serves or needs a GPU",
    )
    parser.add_argument("--match", metavar="TEXT", help="only commands containing TEXT")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds per command before it is killed (default: %(default)s)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
