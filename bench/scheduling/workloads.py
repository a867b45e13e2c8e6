"""The scheduling experiments' requests: held-out prompts with the target's true answer lengths.

The length predictor's build (`python -m distill.lengths build`) answers evaluation prompts of
every kind with the target, greedily, and commits them as labelled data: the user message, the
length of the target's answer, and what the predictor predicted for it. Those prompts are never
trained on, so they are the experiments' requests too: a simulated request carries the prompt's
token ids (the learned predictor reads them) and the same `max_tokens` as every other one (the
cap the answers were generated under, `MAX_TOKENS`), and ends where the target's answer ended
(EOS, or that cap); only the `oracle` predictor is told its length. A replayed one sends the
message with `max_tokens` set to the answer's length and `ignore_eos` (so that the output is the
target's own answer, whatever the serving precision), which a predictor clipping at `max_tokens`
can read: the real replays are not a test of a length predictor.

Workloads, by the kind of prompt: `chat` (ShareGPT), `code` (HumanEval), `long` (GSM8K answered
step by step: the longest answers of the three) and `mix` (all of them).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.model.model_set import REPO_ROOT
from tools.load.trace import TraceRequest
from tools.sim.simulator import SimRequest

HELDOUT = REPO_ROOT / "models" / "length-predictor" / "heldout-SmolLM2-135M-Instruct.jsonl"
# The cap the labelled answers were generated under (`distill.lengths build --max-new-tokens`):
# the `max_tokens` every simulated request carries, whatever its answer's length
MAX_TOKENS = 512
WORKLOADS: dict[str, tuple[str, ...]] = {
    "chat": ("chat",),
    "code": ("code",),
    "long": ("math",),
    "mix": ("chat", "code", "math"),
}


@dataclass(frozen=True)
class Labelled:
    kind: str
    index: int  # within its kind's evaluation range (also the recorded session it follows)
    message: str
    prompt_ids: tuple[int, ...]
    num_output_tokens: int  # the target's greedy answer, EOS excluded


def load_heldout(tokenizer: Any, path: Path = HELDOUT) -> list[Labelled]:
    """The labelled held-out prompts, chat-templated with `tokenizer` (answers of at least one
    token only: an empty answer is no request to schedule)."""
    if not path.is_file():
        raise FileNotFoundError(f"no labelled prompts at {path}: python -m distill.lengths build")
    items = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if int(row["num_output_tokens"]) < 1:
            continue
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["message"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        items.append(
            Labelled(
                str(row["kind"]),
                int(row["index"]),
                str(row["message"]),
                tuple(int(t) for t in ids),
                int(row["num_output_tokens"]),
            )
        )
    return items


def pool(items: Sequence[Labelled], workload: str) -> list[Labelled]:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {sorted(WORKLOADS)}")
    return [item for item in items if item.kind in WORKLOADS[workload]]


def draw(items: Sequence[Labelled], n: int, seed: int) -> list[Labelled]:
    """`n` prompts in a random order (the order they arrive in): distinct while the pool lasts,
    then the pool again, reshuffled (the code pool holds 40 prompts)."""
    if not items:
        raise ValueError("no prompts to draw from")
    rng = random.Random(seed)
    out: list[Labelled] = []
    while len(out) < n:
        out += rng.sample(list(items), min(n - len(out), len(items)))
    return out


def sim_requests(
    items: Sequence[Labelled], arrivals: Sequence[float], max_tokens: int = MAX_TOKENS
) -> list[SimRequest]:
    """Requests that all carry `max_tokens` and end at their answers' lengths."""
    return [
        SimRequest(
            arrival_s=at,
            num_prompt_tokens=len(item.prompt_ids),
            num_output_tokens=item.num_output_tokens,
            kind=item.kind,
            prompt_tokens=item.prompt_ids,
            session_key=item.index,
            max_tokens=max_tokens,
        )
        for item, at in zip(items, arrivals, strict=True)
    ]


def trace_requests(items: Sequence[Labelled], arrivals: Sequence[float]) -> list[TraceRequest]:
    return [
        TraceRequest(
            arrival_s=at,
            output_length=item.num_output_tokens,
            prompt=item.message,
            kind=item.kind,
        )
        for item, at in zip(items, arrivals, strict=True)
    ]


def burst(n: int, spacing_s: float = 0.0) -> list[float]:
    """`n` arrivals at (almost) the same time, in order, as in the paper's experiment."""
    return [i * spacing_s for i in range(n)]


def poisson(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append(at)
    return out
