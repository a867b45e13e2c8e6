"""Which documented commands a smoke run may run, and at what size.

`skip_reason` says why a command is left out of a smoke run (it installs or downloads, needs a
GPU or Docker, or shows placeholders that `fill_placeholders` has no value for); `shrink` turns
a command's size flags down to the values of `SMALL_SIZES`, and `with_implied_sizes` adds those
of a command that runs at its module's (large) defaults. Servers and the commands that need one:
`server_probe`, `needs_server` (tools/doc_servers.py starts them)."""

from __future__ import annotations

import re
import shlex

from tools.doc_extract import shell_join

DOC_PORT = 8000  # the gateway port the docs' commands name
LOCAL_SERVER = rf"(?:127\.0\.0\.1|localhost):{DOC_PORT}"  # the docs' server, in a command

# size flag -> the small values a smoke run passes instead of the documented ones
SMALL_SIZES: dict[str, tuple[str, ...]] = {
    "--max-tokens": ("8",),
    "--per-kind": ("1",),
    "--requests": ("4",),
    "--reps": ("1",),
    "--steps": ("2",),
    "--rounds": ("1",),
    "--count": ("4",),
    "--duration": ("5",),
    "--history": ("20",),
    "--limit": ("20",),
    "--concurrency": ("1",),
    "--copies": ("1",),
    "--n": ("1",),
    "--max-new-tokens": ("16",),
    "--repeats": ("1",),
}
# module (and subcommand) -> size flags it runs at their large defaults without: added
IMPLIED_SIZES: dict[str, tuple[str, ...]] = {
    "bench.bench_model_free": ("--per-kind", "--max-tokens"),
    "bench.bench_model_set": ("--per-kind", "--max-tokens"),
    "bench.bench_cells": ("--requests", "--max-tokens"),
    "tools.chaos": ("--requests", "--max-tokens"),
    "distill eval": ("--n", "--max-new-tokens"),
    "tools.profile": ("--repeats", "--max-tokens"),
    "bench.bench_services": ("--requests", "--max-tokens", "--rounds"),
    "bench.drafters mixed": ("--per-kind",),
}
# placeholder flag -> the value a smoke run gives it (optional `[--x X]` groups are left out)
PLACEHOLDER_VALUES: dict[str, str] = {"--rate": "1"}
_MANY_VALUES = {"--concurrency"}  # nargs="+": every value up to the next flag is replaced

_SKIPS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\binstall\b|install-[\w.-]+\.sh|apt-get"), "installs packages"),
    (
        re.compile(rf"\bwget\b|\bdownload\b|huggingface-cli|\bcurl\b(?!.*{LOCAL_SERVER})"),
        "downloads",
    ),
    (re.compile(r"\bdocker\b"), "needs Docker"),
    (
        re.compile(r"qwen2\.5-coder"),
        "needs the qwen2.5-coder models (scripts/install-qwen-coder.sh)",
    ),
    (re.compile(r"\bcuda\b|nvidia-smi"), "needs a GPU"),
    (re.compile(r"\bredis-server\b|\bredis-cli\b"), "runs Redis by hand"),
    (re.compile(r"\[--|\.\.\.|(?:^| )--[\w-]+ (?:[A-Z]+|NAME|PATH)(?: |$)"), "shows placeholders"),
)


# what even --run leaves out: the scratch copy shares models/ with the repository
_UNSAFE = re.compile(r"--out[= ]models/")


def unsafe_reason(line: str) -> str | None:
    """Why no run, smoke or full, may run `line`, or None."""
    return "writes into models/, which the scratch copy shares" if _UNSAFE.search(line) else None


def skip_reason(line: str) -> str | None:
    """Why a smoke run leaves `line` out, or None to run it."""
    if (unsafe := unsafe_reason(line)) is not None:
        return unsafe
    for pattern, reason in _SKIPS:
        if pattern.search(line):
            return reason
    return None


_SERVER = re.compile(r"-m services (all|verifier|scheduler|drafter|gateway)\b|scripts/serve\.sh")
_NEEDS_SERVER = re.compile(rf"--base-url|redis://|-m services health|\bcurl\b.*{LOCAL_SERVER}")


def server_probe(line: str) -> str | None:
    """The service whose readiness (`python -m services health`) says the server `line` starts
    is up: the gateway for a whole stack; None if `line` starts no server."""
    found = _SERVER.search(line)
    if found is None:
        return None
    if found.group(1) not in (None, "all"):
        return found.group(1)
    return "scheduler" if "--no-gateway" in line else "gateway"


def starts_a_stack(line: str) -> bool:
    """Whether the server `line` starts is a whole stack (not one service of a split one)."""
    found = _SERVER.search(line)
    return found is not None and found.group(1) in (None, "all")


def needs_server(line: str) -> bool:
    return _NEEDS_SERVER.search(line) is not None and server_probe(line) is None


def fill_placeholders(line: str) -> str:
    """`line` without its optional `[--x X]` groups, each `--flag R` of `PLACEHOLDER_VALUES`
    given its value."""
    line = re.sub(r"\s*\[--[^\]]*\]", "", line)
    for flag, value in PLACEHOLDER_VALUES.items():
        line = re.sub(rf"(?<!\S){re.escape(flag)} [A-Z](?!\S)", f"{flag} {value}", line)
    return line


def with_implied_sizes(line: str) -> str:
    """`line` with the `IMPLIED_SIZES` flags of its module that it does not pass, small."""
    words = shlex.split(line)
    if "-m" not in words:
        return line
    at = words.index("-m") + 1
    passed = {word.partition("=")[0] for word in words}
    for module, flags in IMPLIED_SIZES.items():
        if words[at : at + len(module.split())] == module.split():
            for flag in flags:
                if flag not in passed:
                    words += [flag, *SMALL_SIZES[flag]]
    return shell_join(words)


def shrink(line: str) -> str:
    """`line` with each size flag's values replaced by its `SMALL_SIZES` values."""
    words = shlex.split(line)
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        flag, _, inline = word.partition("=")
        if flag in SMALL_SIZES:
            small = SMALL_SIZES[flag]
            if inline:
                out.append(f"{flag}={small[0]}")
                i += 1
                continue
            out += [flag, *small]
            i += 2  # the flag and its documented value
            while flag in _MANY_VALUES and i < len(words) and not words[i].startswith("-"):
                i += 1
            continue
        out.append(word)
        i += 1
    return shell_join(out)
