"""One request's output as it arrives: ordering, repeats, detokenization, client-side metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.gateway.body import APIError, Tokenizer
from services.gateway.metrics import GatewayMetrics
from shared.wire import FinishReason, RequestError, Tokens

# How the scheduler's error codes answer over HTTP.
ERROR_STATUS = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "model_not_found": 404,
    "overloaded": 503,
}


@dataclass
class Progress:
    started: float  # monotonic clock at arrival
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    first_token_at: float | None = None
    last_chunk_at: float | None = None
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps_by_draft: dict[str, int] = field(default_factory=dict)  # draft model -> steps it drafted

    def acceptance(self) -> dict[str, Any]:
        """Per-request speculation statistics, as vLLM defines them."""
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens
            if self.draft_tokens
            else None,
            "mean_accepted_length": 1 + self.accepted_tokens / self.drafts if self.drafts else None,
            "steps_by_draft": dict(self.steps_by_draft),
        }


def _error(message: RequestError) -> APIError:
    status = ERROR_STATUS.get(message.code, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return APIError(status, message.message, kind=kind, param=message.param, code=message.code)


def _count(message: Tokens, fresh: int, progress: Progress, metrics: GatewayMetrics) -> None:
    now = time.monotonic()
    if fresh and progress.first_token_at is None:
        progress.first_token_at = now
        metrics.time_to_first_token.observe(now - progress.started)
    elif fresh and progress.last_chunk_at is not None:
        per_token = (now - progress.last_chunk_at) / fresh
        for _ in range(fresh):
            metrics.inter_token_latency.observe(per_token)
    if fresh:
        progress.last_chunk_at = now
    progress.drafts += message.drafts
    progress.draft_tokens += message.draft_tokens
    progress.accepted_tokens += message.accepted_tokens
    if message.draft_model:
        steps = progress.steps_by_draft
        steps[message.draft_model] = steps.get(message.draft_model, 0) + message.drafts
    metrics.spec_drafts.inc(message.drafts)
    metrics.spec_draft_tokens.inc(message.draft_tokens)
    metrics.spec_accepted_tokens.inc(message.accepted_tokens)
    for position in range(message.accepted_tokens):
        metrics.spec_accepted_per_pos.labels(position=str(position)).inc()


def _new_text(progress: Progress, tokenizer: Tokenizer) -> str:
    """Incremental detokenization; an incomplete UTF-8 sequence waits for the next tokens."""
    text = tokenizer.decode(progress.token_ids, skip_special_tokens=True)
    if text.endswith("\ufffd") and progress.finish is None:
        return ""
    delta = text[len(progress.text) :]
    progress.text = text
    return delta


async def follow(
    queue: asyncio.Queue[Tokens | RequestError],
    progress: Progress,
    tokenizer: Tokenizer,
    metrics: GatewayMetrics,
    idle_timeout_s: float,
) -> AsyncIterator[str]:
    """Yield text deltas in order until the request finishes; drop repeats, refuse gaps."""
    while progress.finish is None:
        try:
            async with asyncio.timeout(idle_timeout_s):  # (3.11's wait_for can eat a cancel)
                message = await queue.get()
        except TimeoutError:
            raise APIError(
                503, "no output from the scheduler in time", kind="server_error", code="timeout"
            ) from None
        if isinstance(message, RequestError):
            raise _error(message)
        have = len(progress.token_ids)
        if message.offset > have:
            raise APIError(500, "tokens were lost", kind="server_error", code="internal_error")
        if message.offset + len(message.token_ids) <= have and message.finish is None:
            continue  # a redelivered step
        fresh = list(message.token_ids[have - message.offset :])
        _count(message, len(fresh), progress, metrics)
        progress.token_ids.extend(fresh)
        progress.finish = message.finish
        if message.finish is FinishReason.ABORT:
            raise APIError(500, "the request was aborted", kind="server_error", code="aborted")
        yield _new_text(progress, tokenizer)
