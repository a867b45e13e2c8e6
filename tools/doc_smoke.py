"""Which documented commands a smoke run may run, and at what size.

`skip_reason` says why a command is left out of a smoke run (it installs or downloads, starts a
server that does not exit, needs a running one, a GPU or Docker, or shows placeholders instead of
values); `shrink` turns a command's size flags down to the values of `SMALL_SIZES`."""

from __future__ import annotations

import re
import shlex

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
}
_MANY_VALUES = {"--concurrency"}  # nargs="+": every value up to the next flag is replaced

_SKIPS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\binstall\b|install-[\w.-]+\.sh|apt-get"), "installs packages"),
    (re.compile(r"\bcurl\b|\bwget\b|\bdownload\b|huggingface-cli"), "downloads or calls a server"),
    (re.compile(r"\bdocker\b"), "needs Docker"),
    (
        re.compile(r"qwen2\.5-coder"),
        "needs the qwen2.5-coder models (scripts/install-qwen-coder.sh)",
    ),
    (re.compile(r"\bcuda\b|nvidia-smi"), "needs a GPU"),
    (re.compile(r"--base-url|redis://|\bredis-cli\b|-m services health"), "needs a running server"),
    (
        re.compile(r"-m services\b|scripts/serve\.sh|\bredis-server\b|&$"),
        "starts a long-lived server",
    ),
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
    return shlex.join(out)
