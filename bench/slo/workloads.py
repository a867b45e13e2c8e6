"""The SLO experiments' requests: AdaServe's mix of three TPOT classes over a bursty trace.

Each request draws its class by the shares (60/20/20 by default, AdaServe §6.2): `urgent`
(1.0x the machine's baseline latency, AdaServe's category 1: agents, code completion) and
`relaxed` (8x) are chat requests (held-out ShareGPT prompts answered by the target, so their
true answer lengths are known); `standard` (2.4x, category 2: search) are long-context
summarization-like requests, as AdaServe pairs search with ArXiv summarization: a long text
from the chat dataset with an instruction to summarize it, answered in `summary_tokens`.
Arrivals come from a gamma renewal process with a coefficient of variation above 1 (bursty,
as the SplitWise trace AdaServe replays).

A simulated request carries token counts; a replayed one sends its message with `max_tokens`
= the answer length and `ignore_eos`, and its objective as an explicit `tpot_slo_ms` (its class
name labels it in the report; `tools/load/client.py` sends the class only without an objective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.scheduling.workloads import Labelled, pool
from tools.load.arrivals import arrival_times
from tools.load.prompts import PromptBuilder
from tools.load.trace import TraceRequest
from tools.sim.simulator import SimRequest

CLASSES = ("urgent", "standard", "relaxed")  # AdaServe's categories 1, 2 and 3
SHARES = (0.6, 0.2, 0.2)
LONG_CLASS = "standard"  # the summarization-like class
SUMMARY_INSTRUCTION = "Summarize the following text in a few sentences.\n\n"
BURST_CV = 2.0  # gamma arrivals' coefficient of variation


@dataclass(frozen=True)
class SloRequest:
    arrival_s: float
    slo_class: str
    tpot_slo_ms: float
    kind: str  # chat or summary
    message: str
    num_prompt_tokens: int
    num_output_tokens: int
    session_key: int  # the recorded acceptance session it follows in the simulator


@dataclass(frozen=True)
class Mix:
    """What a workload is made of; `multiples` are the classes' TPOTs over the baseline."""

    shares: tuple[float, float, float] = SHARES
    multiples: tuple[float, float, float] = (1.0, 2.4, 8.0)
    summary_prompt_tokens: int = 256
    summary_tokens: int = 128

    def objectives_ms(self, baseline_ms: float) -> dict[str, float]:
        return {c: m * baseline_ms for c, m in zip(CLASSES, self.multiples, strict=True)}


def urgent_share_mix(share: float, base: Mix = Mix()) -> Mix:
    """AdaServe's Fig. 6: `share` urgent, the rest split between the other two as 20:20."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"an urgent share is within [0, 1], got {share}")
    rest = (1.0 - share) / 2
    return Mix((share, rest, rest), base.multiples, base.summary_prompt_tokens, base.summary_tokens)


class Workload:
    """Builds request lists from the held-out chat prompts and summarization texts."""

    def __init__(self, tokenizer: Any, heldout: Sequence[Labelled], seed: int = 0) -> None:
        self.chat = pool(heldout, "chat")
        if not self.chat:
            raise ValueError("no held-out chat prompts")
        self._builder = PromptBuilder(tokenizer, seed)
        self._summaries: dict[int, tuple[str, int]] = {}

    def _summary(self, index: int, prompt_tokens: int) -> tuple[str, int]:
        """The `index`-th summarization message of about `prompt_tokens` templated tokens."""
        if index not in self._summaries:
            text = self._builder.text("chat", prompt_tokens)
            message = SUMMARY_INSTRUCTION + text
            self._summaries[index] = (message, self._builder.templated_length(message))
        return self._summaries[index]

    def requests(
        self, rate: float, count: int, baseline_ms: float, mix: Mix = Mix(), seed: int = 0
    ) -> list[SloRequest]:
        """`count` requests arriving at `rate` per second (bursty), classes drawn by `mix`."""
        arrivals = arrival_times(rate, count=count, process="gamma", cv=BURST_CV, seed=seed)
        rng = np.random.default_rng(seed)
        classes = rng.choice(len(CLASSES), size=count, p=np.asarray(mix.shares) / sum(mix.shares))
        chats = rng.permutation(count) % len(self.chat)
        objectives = mix.objectives_ms(baseline_ms)
        out = []
        for i, (at, c) in enumerate(zip(arrivals.tolist(), classes.tolist(), strict=True)):
            name = CLASSES[c]
            if name == LONG_CLASS:
                message, length = self._summary(i % 16, mix.summary_prompt_tokens)
                out.append(
                    SloRequest(
                        at, name, objectives[name], "summary", message, length,
                        mix.summary_tokens, i,
                    )
                )  # fmt: skip
            else:
                item = self.chat[int(chats[i])]
                out.append(
                    SloRequest(
                        at, name, objectives[name], "chat", item.message, len(item.prompt_ids),
                        item.num_output_tokens, item.index,
                    )
                )  # fmt: skip
        return out


def sim_requests(requests: Sequence[SloRequest]) -> list[SimRequest]:
    """Summaries follow recorded chat sessions: no summarization was recorded."""
    return [
        SimRequest(
            arrival_s=r.arrival_s,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            kind="chat",
            slo_class=r.slo_class,
            tpot_slo_ms=r.tpot_slo_ms,
            session_key=r.session_key,
        )
        for r in requests
    ]


def trace_requests(requests: Sequence[SloRequest]) -> list[TraceRequest]:
    return [
        TraceRequest(
            arrival_s=r.arrival_s,
            output_length=r.num_output_tokens,
            prompt=r.message,
            kind=r.kind,
            tpot_slo_ms=r.tpot_slo_ms,
            slo_class=r.slo_class,
        )
        for r in requests
    ]
