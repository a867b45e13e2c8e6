"""The requests of a chaos run: token-id prompts from the repo's evaluation prompt sets and
their open-loop send times, all fixed by a seed."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.datasets import KINDS, eval_prompts
from tools.load.arrivals import arrival_times
from tools.prompts import chat_ids


@dataclass(frozen=True)
class ChaosRequest:
    index: int
    kind: str  # the prompt set it came from: chat, code or math
    prompt_ids: tuple[int, ...]
    max_tokens: int
    send_at_s: float  # seconds after the replay's start


def load_tokenizer(target: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def make_workload(
    tokenizer: Any,
    *,
    count: int,
    rate: float,
    max_tokens: int,
    prompt_tokens: int,
    seed: int,
) -> list[ChaosRequest]:
    """`count` requests at `rate` req/s (Poisson arrivals from `seed`), taking chat, code and
    math evaluation prompts in turn, each templated and cut to its last `prompt_tokens` ids."""
    per_kind = -(-count // len(KINDS))
    texts = {kind: iter(eval_prompts(kind, per_kind)) for kind in KINDS}
    kinds = itertools.cycle(KINDS)
    times = arrival_times(rate, count=count, seed=seed)
    requests = []
    for index, send_at in enumerate(times):
        kind = next(kinds)
        ids = chat_ids(tokenizer, next(texts[kind]), keep=prompt_tokens)
        requests.append(ChaosRequest(index, kind, tuple(ids), max_tokens, float(send_at)))
    return requests
