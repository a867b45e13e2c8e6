"""The commands the README and the reference docs show, read from their fenced code blocks, and
a static check of the repository's own ones: the module or script exists and declares every flag
passed (`problems_of`). Shared by tests/test_doc_commands.py and `python -m tools.doc_commands`."""

from __future__ import annotations

import ast
import functools
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("tools", "bench", "shared", "services", "distill", "kernels")
PYTHON = re.compile(r"^(?:\S*/)?python3?$")


ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")  # a leading `NAME=value` of a shell command


def fenced_blocks(text: str) -> list[list[str]]:
    """The logical lines of each fenced code block (continuations joined, comments cut)."""
    blocks, block, inside = [], [], False
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            if inside and (lines := join_continued(block)):
                blocks.append(lines)
            inside, block = not inside, []
            continue
        if inside:
            block.append(raw)
    return blocks


def fenced_lines(text: str) -> list[str]:
    """The logical lines of the fenced code blocks, one list."""
    return [line for block in fenced_blocks(text) for line in block]


def assignments(line: str) -> dict[str, str]:
    """The leading `NAME=value` environment assignments of a shell command line."""
    every = shlex.split(line.rstrip().removesuffix("&"))
    words = without_assignments(every)
    return dict(word.split("=", 1) for word in every[: len(every) - len(words)])


def shell_join(words: list[str]) -> str:
    """`shlex.join`, but a leading `NAME=value` quotes its value only (a quoted whole
    assignment would be a command name to the shell)."""
    rest = without_assignments(words)
    leading = [
        f"{name}={shlex.quote(value)}"
        for name, _, value in (w.partition("=") for w in words[: len(words) - len(rest)])
    ]
    return " ".join([*leading, shlex.join(rest)]) if leading else shlex.join(rest)


def without_assignments(words: list[str]) -> list[str]:
    """A command's words after its leading `NAME=value` environment assignments."""
    i = 0
    while i < len(words) and ASSIGNMENT.match(words[i]):
        i += 1
    return words[i:]


def join_continued(block: list[str]) -> list[str]:
    joined, pending = [], ""
    for line in block:
        line = line.split(" #")[0].rstrip() if " #" in line else line.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined.append((pending + line).strip())
        pending = ""
    return [line for line in joined if line]


def module_file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    return None


def flag_pattern(node: ast.AST) -> str | None:
    """A regex of the '--x' flag a string constant or f-string spells, if it spells one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value) if node.value.startswith("--") else None
    if isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if isinstance(head, ast.Constant) and str(head.value).startswith("--"):
            return "".join(
                re.escape(str(v.value)) if isinstance(v, ast.Constant) else r"[\w-]+"
                for v in node.values
            )
    return None


@functools.cache
def _module_flags_and_imports(path: Path) -> tuple[frozenset[str], tuple[Path, ...]]:
    """The '--x' flag patterns one module spells, and the repository modules it imports."""
    tree = ast.parse(path.read_text())
    flags = frozenset(pattern for node in ast.walk(tree) if (pattern := flag_pattern(node)))
    deps = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.split(".")[0] in PACKAGES and (dep := module_file(name)) is not None:
                deps.append(dep)
    return flags, tuple(deps)


@functools.cache
def declared_flags(path: Path) -> frozenset[str]:
    """Patterns of the '--x' flags a module and the repository modules it imports spell
    (imports that run in a circle, as a package's `__main__` and a module importing the
    package do, are followed once)."""
    flags: set[str] = set()
    todo, seen = [path], {path}
    while todo:
        own, deps = _module_flags_and_imports(todo.pop())
        flags |= own
        fresh = list(dict.fromkeys(dep for dep in deps if dep not in seen))
        seen.update(fresh)
        todo.extend(fresh)
    return frozenset(flags)


def script_module(script: Path) -> str | None:
    """The module a wrapper script runs with `python -m`, if it runs one."""
    found = re.search(r"-m\s+([A-Za-z_][\w.]*)", script.read_text())
    return found.group(1) if found else None


def commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for line in fenced_lines(doc.read_text()):
            found.append((doc.relative_to(ROOT).as_posix(), line))
    return found


def problems_of(line: str) -> list[str] | None:
    """What is wrong with a command line; None if it is not a command of this repository."""
    try:
        words = without_assignments(shlex.split(line.removesuffix("&")))
    except ValueError:
        return None
    if len(words) >= 3 and PYTHON.match(words[0]) and words[1] == "-m":
        module, args = words[2], words[3:]
        path = module_file(module)
    elif len(words) >= 2 and words[0] == "bash" and words[1].startswith("scripts/"):
        script = ROOT / words[1]
        if not script.is_file():
            return [f"no script {words[1]}"]
        module, args = script_module(script) or "", words[2:]
        path = module_file(module)
    else:
        return None
    if module.split(".")[0] not in PACKAGES:
        return None  # a third-party tool (pytest): not ours to check
    if path is None:
        return [f"no module {module}"]
    if "..." in args:
        return []
    patterns = declared_flags(path)
    flags = [a.split("=")[0] for a in args if a.startswith("--")]
    unknown = [f for f in flags if not any(re.fullmatch(p, f) for p in patterns)]
    return [f"{module} declares no {flag}" for flag in unknown]
