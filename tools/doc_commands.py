"""List, and optionally run, every command the README and the reference docs show.

    python -m tools.doc_commands                    # list them, with what a smoke run would do
    python -m tools.doc_commands --run              # run each as written (hours: the benchmarks)
    python -m tools.doc_commands --smoke --match traces   # small sizes; skips what cannot run here
    python -m tools.doc_commands --smoke --doc docs/services.md   # one doc's commands, in order

Each command runs in a scratch copy of the repository's files (the virtual environment and
models/ linked in), in doc order, `python` being this interpreter, with a per-command timeout and
the `export NAME=value` lines of its code block before it in its environment; a script that sets
up first (`bash scripts/generate.sh ...`) runs as the module it calls after its set-up. A smoke
run also writes the format fixtures of the traces the docs download (tools/doc_fixtures.py), and
starts the servers the docs start, in the background, for the commands after them in their doc
(tools/doc_servers.py): a server passes once it is ready, `curl` lines to its port run against it.
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
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from tools.doc_extract import (
    DOCS,
    PYTHON,
    ROOT,
    fenced_blocks,
    problems_of,
    shell_join,
    without_assignments,
)
from tools.doc_fixtures import write_fixtures
from tools.doc_servers import Servers
from tools.doc_smoke import (
    DOC_PORT,
    LOCAL_SERVER,
    fill_placeholders,
    needs_server,
    server_probe,
    shrink,
    skip_reason,
    unsafe_reason,
    with_implied_sizes,
)
from tools.ports import free_port, port_free
from tools.redis_cluster import redis_cluster
from tools.redis_server import redis_node

LINKED = (".venv", "models")  # ignored by git, large, and read by the commands


@dataclass(frozen=True)
class Command:
    doc: str
    line: str
    env: tuple[tuple[str, str], ...] = ()  # exported earlier in its code block


_LOCAL_CURL = re.compile(rf"^curl\b.*\b{LOCAL_SERVER}\b")


def documented_commands(match: str | None = None) -> list[Command]:
    """The repository's commands (`python -m` of its packages, `bash scripts/...`) and the
    `curl` lines to the docs' local server, in doc order, each once, those containing `match`
    if given."""
    seen: set[str] = set()
    found = []
    for path in DOCS:
        doc = path.relative_to(ROOT).as_posix()
        for block in fenced_blocks(path.read_text()):
            env: dict[str, str] = {}
            for line in block:
                env.update(exported(line))
                ours = problems_of(line) is not None or is_local_curl(line)
                if not ours or line in seen or (match and match not in line):
                    continue
                seen.add(line)
                found.append(Command(doc, line, tuple(env.items())))
    return found


def is_local_curl(line: str) -> bool:
    """A whole `curl` line (not one cut at a quoted body's line break) to the docs' server."""
    try:
        shlex.split(line)
    except ValueError:
        return False
    return _LOCAL_CURL.match(line) is not None


def smoke_form(line: str) -> str:
    """`line` as a smoke run runs it: placeholders filled, sizes small (a `curl` as written)."""
    line = fill_placeholders(line)
    if line.startswith("curl"):
        return line
    background = line.rstrip().endswith("&")
    line = with_implied_sizes(shrink(line.rstrip().removesuffix("&")))
    return line + (" &" if background else "")


def exported(line: str) -> dict[str, str]:
    """The variables an `export NAME=value ...` line sets (none for any other line)."""
    try:
        words = shlex.split(line)
    except ValueError:
        return {}
    if not words or words[0] != "export":
        return {}
    return dict(word.split("=", 1) for word in words[1:] if "=" in word)


def as_run(line: str) -> str:
    """The line with its python (`python`, `.venv/bin/python`) as this interpreter, and a script
    that first sets up (scripts/setup.sh: a venv, pip installs) as the module it then runs:
    run from a scratch copy, the set-up would install this copy into the environment."""
    background = line.rstrip().endswith("&")
    every = shlex.split(line.rstrip().removesuffix("&"))
    words = without_assignments(every)
    assignments = every[: len(every) - len(words)]
    if words and words[0] == "curl":
        return line  # a pipeline: as written
    if words and PYTHON.match(words[0]):
        words[0] = sys.executable
    elif len(words) >= 2 and words[0] == "bash" and (call := _call_after_setup(ROOT / words[1])):
        words = [sys.executable, *call, *words[2:]]
    return shell_join([*assignments, *words]) + (" &" if background else "")


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


def run_one(
    line: str, cwd: Path, timeout_s: float, env: dict[str, str] | None = None
) -> tuple[str, float, str]:
    """(pass | fail | timeout, seconds, the output's tail) of one command, its process group
    killed at the timeout; `env` added to this process's environment."""
    started = time.monotonic()
    process = subprocess.Popen(
        line,
        shell=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
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
    found = [c for c in documented_commands(args.match) if not args.doc or c.doc in args.doc]
    if not (args.run or args.smoke):
        for command in found:
            reason = skip_reason(fill_placeholders(command.line))
            note = f"smoke: skip ({reason})" if reason else f"smoke: {smoke_form(command.line)}"
            print(f"{command.doc}: {command.line}\n    {note}")
        print(f"{len(found)} commands")
        return 0
    counts = {"pass": 0, "fail": 0, "timeout": 0, "skip": 0}
    with tempfile.TemporaryDirectory(prefix="doc-commands-") as scratch, ExitStack() as stack:
        cwd = scratch_copy(Path(scratch))
        for name in write_fixtures(cwd) if args.smoke else ():
            print(f"fixture  {name}  (synthetic, in the downloaded trace's format)", flush=True)
        servers = None
        if any(server_probe(c.line) for c in found):
            port = DOC_PORT if port_free(DOC_PORT) else free_port()
            (logs := Path(scratch) / "server-logs").mkdir()
            node = stack.enter_context(redis_node(Path(scratch)))
            (cluster := Path(scratch) / "redis-cluster").mkdir()
            servers = Servers(
                cwd,
                node,
                port,
                logs,
                start_cluster=lambda: stack.enter_context(redis_cluster(cluster)).url,
            )
            stack.callback(servers.stop)
        doc = None
        for command in found:
            if servers is not None and command.doc != doc:
                servers.stop()  # a doc's servers serve its own commands only
            doc = command.doc
            status = run_command(command, cwd, servers, args)
            counts[status] += 1
    print(", ".join(f"{n} {status}" for status, n in counts.items()))
    return 1 if counts["fail"] or counts["timeout"] else 0


def run_command(
    command: Command,
    cwd: Path,
    servers: Servers | None,
    args: argparse.Namespace,
) -> str:
    """Run (or skip) one command, print its outcome: pass | fail | timeout | skip."""
    line = fill_placeholders(command.line) if args.smoke else command.line
    reason = skip_reason(line) if args.smoke else unsafe_reason(line)
    live = servers is not None and bool(servers.running)
    if reason is None and needs_server(line) and not live:
        reason = "needs a running server; its doc starts none before it"
    if reason is not None:
        print(f"skip     {command.doc}: {command.line}  ({reason})", flush=True)
        return "skip"
    if args.smoke:
        line = smoke_form(line)
    env = dict(command.env)
    if servers is not None:
        line = servers.as_here(line)
        if server_probe(line) is not None:
            status, seconds, tail = servers.start(line, as_run(line), env, args.timeout)
            return report(status, f"{command.doc}: {line}  [ready in {seconds:.0f} s]", tail)
        if live:
            env |= servers.env(env)
    status, seconds, tail = run_one(as_run(line), cwd, args.timeout, env)
    return report(status, f"{command.doc}: {line}  [{seconds:.0f} s]", tail)


def report(status: str, what: str, tail: str) -> str:
    """Print a command's outcome (the output's tail unless it passed); the status."""
    print(f"{status:<8} {what}", flush=True)
    if status != "pass":
        print("    " + tail.replace("\n", "\n    "), flush=True)
    return status


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
        "--doc",
        action="append",
        metavar="PATH",
        help="only the commands of PATH (docs/x.md); repeat for more docs",
    )
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
