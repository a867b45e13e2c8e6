"""One request of a trace, as every reader returns it and every writer takes it."""

from __future__ import annotations

from dataclasses import dataclass


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and the line."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds from the trace's start (Mooncake's `timestamp` is in ms)
    input_length: int | None = None  # prompt tokens; None: whatever `prompt`/`messages` make
    output_length: int | None = None  # output tokens to generate (honoured with ignore_eos)
    prompt: str | None = None  # completion-style text (sent as one user message)
    messages: tuple[tuple[str, str], ...] | None = None  # chat turns: (role, content)
    kind: str | None = None  # chat, code, math, ... (prompts are built from that dataset)
    tpot_slo_ms: float | None = None
    slo_class: str | None = None
    priority: int = 0
    max_tokens: int | None = None  # None: output_length
    temperature: float | None = None  # None: greedy (0.0)
    app: str | None = None  # the application key sent as `augury.app`
    # Mooncake's prefix block hashes (512 tokens a block): equal ids, equal prefix blocks
    hash_ids: tuple[int, ...] | None = None

    @property
    def num_output_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.output_length
