"""One request's output as it arrives: ordering, repeats, detokenization, client-side metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.gateway.body import APIError
from services.gateway.metrics import GatewayMetrics
from shared.scheduling.slo_classes import CUSTOM_CLASS
from shared.text.stop_strings import OutputText
from shared.values.logprobs import EMPTY, TokenLogprobs
from shared.wire import FinishReason, RequestError, Tokens

# How the scheduler's error codes answer over HTTP.
ERROR_STATUS = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "model_not_found": 404,
    "overloaded": 503,
    "gateway_lost": 503,  # the scheduler missed this gateway's heartbeat and cancelled
}


@dataclass
class Progress:
    started: float  # monotonic clock at arrival
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    stop_reason: str | None = None  # the stop string that ended the output, if one did
    first_token_at: float | None = None
    last_chunk_at: float | None = None
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps_by_draft: dict[str, int] = field(default_factory=dict)  # draft model -> steps it drafted
    # from the scheduler's last message: the request's class, objective and measured TPOT
    slo_class: str | None = None
    tpot_slo_ms: float | None = None
    tpot_ms: float | None = None
    logprobs: TokenLogprobs = EMPTY  # of token_ids, when the request asked for them
    # of the prompt's tokens after the first (asked with SamplingParams.prompt_logprobs)
    prompt_logprobs: TokenLogprobs | None = None
    # prompt tokens found in the target's prefix cache (None: the scheduler did not say)
    cached_tokens: int | None = None

    @property
    def slo_met(self) -> bool | None:
        """Whether the measured TPOT met the objective (None: no objective, or no TPOT)."""
        if self.tpot_slo_ms is None or self.tpot_ms is None:
            return None
        return self.tpot_ms <= self.tpot_slo_ms

    def statistics(self) -> dict[str, Any]:
        """The `augury` block of a finished answer: speculation and the TPOT objective."""
        return self.acceptance() | {
            "slo_class": self.slo_class,
            "tpot_slo_ms": self.tpot_slo_ms,
            "tpot_ms": self.tpot_ms,
            "slo_met": self.slo_met,
        }

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


def count_slo(metrics: GatewayMetrics, progress: Progress) -> None:
    """Count a finished request against its objective (nothing without one)."""
    if progress.tpot_slo_ms is None:
        return
    attained = progress.slo_met is not False  # no TPOT with fewer than 2 tokens: nothing missed
    label = progress.slo_class or CUSTOM_CLASS
    metrics.slo_requests.labels(slo_class=label, attained=str(attained).lower()).inc()


def _note_objective(message: Tokens, progress: Progress) -> None:
    if message.finish is None:
        return
    progress.slo_class = message.slo_class
    progress.tpot_slo_ms = message.tpot_slo_ms
    progress.tpot_ms = message.tpot_ms
    progress.cached_tokens = message.cached_tokens


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


async def follow(
    queue: asyncio.Queue[Tokens | RequestError],
    progress: Progress,
    text: OutputText,
    metrics: GatewayMetrics,
    idle_timeout_s: float,
) -> AsyncIterator[str]:
    """Yield text deltas in order until the request finishes; drop repeats, refuse gaps.

    A stop string ends the output at the token that completed it (`progress.stop_reason`,
    finish STOP): the tokens after it, and their text, are never taken; the caller cancels
    the scheduler's request."""
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
        step = text.push(fresh)
        fresh = fresh[: step.num_tokens]
        _count(message, len(fresh), progress, metrics)
        _note_objective(message, progress)
        progress.token_ids.extend(fresh)
        if message.prompt_logprobs is not None:
            progress.prompt_logprobs = message.prompt_logprobs
        if message.logprobs is not None:
            progress.logprobs += message.logprobs.tail(have - message.offset).head(len(fresh))
        progress.finish = message.finish
        if step.stop is not None:
            progress.finish, progress.stop_reason = FinishReason.STOP, step.stop
        elif message.finish is FinishReason.ABORT:
            raise APIError(500, "the request was aborted", kind="server_error", code="aborted")
        delta = step.text + (text.finish() if progress.finish is not None else "")
        progress.text = text.text
        yield delta
