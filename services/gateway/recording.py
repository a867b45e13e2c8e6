"""Recording the requests a gateway accepted, for replay: one JSON record per request, appended
to `augury:{cell}:recorded` when the request ends (`tools/load/recording.py` reads them back).

An entry has two fields: `v`, the record format ("1"), and `record`, a JSON object:

    arrival_time     epoch seconds at which the gateway received the request
    input_length     prompt tokens (after the chat template)
    output_length    tokens generated
    finish_reason    stop, length, abort (the scheduler aborted it), error (answered with an
                     error) or cancelled (the client left, or the gateway stopped)
    chat             true for /v1/chat/completions, false for /v1/completions
    max_tokens, temperature, top_p, top_k, ignore_eos, priority, tpot_slo_ms, slo_class,
    draft_model, speculate, stream   the request's options
    ttft_s, e2e_s    seconds to the first token (null without one) and to the end
    messages         with gateway.record_prompts, chat: [{"role", "content"}, ...]
    prompt           with gateway.record_prompts, completions: the text (none for token ids)

Requests refused before they were accepted (a 400, a 429) are not recorded. Each write runs in
a background task with its own bound: a slow or failing Redis never delays or fails a request
(failures are counted and logged); past MAX_PENDING writes waiting at once, records are dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import RedisError

from services.gateway.body import APIError, GenerationRequest
from services.gateway.metrics import GatewayMetrics
from services.gateway.progress import Progress
from shared.bus import Bus
from shared.settings import GatewaySettings
from shared.wire import FinishReason
from shared.wire.streams import recorded_stream

log = logging.getLogger(__name__)

T = TypeVar("T")
RECORD_VERSION = "1"
MAX_PENDING = 1024
WRITE_TIMEOUT_S = 5.0
STOP_GRACE_S = 2.0
WARN_EVERY_S = 10.0


@dataclass
class Outcome:
    """Whether a request was answered with an error (its Progress cannot tell)."""

    failed: bool = False


async def noting_failure(deltas: AsyncIterator[T], outcome: Outcome) -> AsyncIterator[T]:
    """Pass the deltas through; mark the outcome failed when they end in an APIError."""
    try:
        async for delta in deltas:
            yield delta
    except APIError:
        outcome.failed = True
        raise


def finish_reason(finish: FinishReason | None, *, failed: bool) -> str:
    if finish is not None:
        return finish.value
    return "error" if failed else "cancelled"


def build_record(
    gen: GenerationRequest,
    progress: Progress,
    *,
    arrival_time: float,
    ended_at: float,
    failed: bool,
    with_prompt: bool,
) -> dict[str, Any]:
    """The JSON record of one finished request (`ended_at` on the monotonic clock)."""
    sampling = gen.sampling
    first = progress.first_token_at
    record: dict[str, Any] = {
        "arrival_time": arrival_time,
        "input_length": len(gen.prompt_ids),
        "output_length": len(progress.token_ids),
        "finish_reason": finish_reason(progress.finish, failed=failed),
        "chat": gen.chat,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "ignore_eos": sampling.ignore_eos,
        "priority": gen.priority,
        "tpot_slo_ms": gen.tpot_slo_ms,
        "slo_class": gen.slo_class,
        "draft_model": gen.draft_model,
        "speculate": gen.speculate,
        "stream": gen.stream,
        "ttft_s": None if first is None else first - progress.started,
        "e2e_s": ended_at - progress.started,
    }
    if with_prompt and gen.messages is not None:
        record["messages"] = [{"role": role, "content": text} for role, text in gen.messages]
    elif with_prompt and gen.prompt_text is not None:
        record["prompt"] = gen.prompt_text
    return record


class Recorder:
    """Appends records to the cell's recording stream in the background (when enabled)."""

    def __init__(
        self, bus: Bus, settings: GatewaySettings, cell: str, metrics: GatewayMetrics
    ) -> None:
        self.bus = bus
        self.enabled = settings.record_requests
        self.maxlen = settings.record_maxlen
        self.with_prompts = settings.record_prompts
        self.stream = recorded_stream(cell)
        self.metrics = metrics
        self._pending: set[asyncio.Task[None]] = set()
        self._warned_at = -WARN_EVERY_S

    def record(
        self, gen: GenerationRequest, progress: Progress, *, arrival_time: float, failed: bool
    ) -> None:
        """Record a request that ended; returns at once (the write happens in a task)."""
        if not self.enabled:
            return
        if len(self._pending) >= MAX_PENDING:
            self._failed("too many recording writes waiting; a record was dropped")
            return
        record = build_record(
            gen,
            progress,
            arrival_time=arrival_time,
            ended_at=time.monotonic(),
            failed=failed,
            with_prompt=self.with_prompts,
        )
        task = asyncio.create_task(self._write_logged(record), name="gateway-record")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def write(self, record: dict[str, Any]) -> None:
        """One XADD with approximate MAXLEN trimming (raises on a Redis failure)."""
        fields = {"v": RECORD_VERSION, "record": json.dumps(record)}
        await self.bus.redis.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)

    async def _write_logged(self, record: dict[str, Any]) -> None:
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await self.write(record)
        except (RedisError, OSError, TimeoutError) as error:
            self._failed(f"could not record a request: {error!r}")

    def _failed(self, why: str) -> None:
        self.metrics.recording_failures.inc()
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:  # one warning per interval, not per request
            self._warned_at = now
            log.warning("%s (augury_recording_failures counts them all)", why)

    async def stop(self) -> None:
        """Give the writes still waiting a moment to finish, then drop them."""
        if not self._pending:
            return
        _, stuck = await asyncio.wait(set(self._pending), timeout=STOP_GRACE_S)
        for task in stuck:
            task.cancel()
