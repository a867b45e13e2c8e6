"""The chaos run's HTTP client: each request a streamed greedy `/v1/completions` of token ids.

A request whose connection is refused (the gateway is down: nothing listens on its port) never
reached the system; the client tries again every `RETRY_S` until the gateway is back, within
`connect_timeout_s`, and counts the tries. Once connected (accepted: a connection that breaks
while the request is still being written counts), the request ends one of three ways:
its stream finishes (completed), the server says why it failed (an HTTP error status, an
`error` event) or the connection drops (failed, with the error kept), or nothing arrives for
`hang_s` (hung; the client gives up on it). Every chunk's text and the token count its usage
reports are kept, so the report can tell lost from repeated output.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from tools.chaos.workload import ChaosRequest
from tools.sse import RequestFailed, raise_error_event, raise_for_status, stream_events

PATH = "/v1/completions"
RETRY_S = 0.25
COMPLETED, FAILED, HUNG = "completed", "failed", "hung"


@dataclass
class Chunk:
    at_s: float  # seconds after the replay's start
    completion_tokens: int  # the usage the chunk reports: tokens generated so far
    text: str


@dataclass
class Received:
    """What the client saw of one request; times in seconds after the replay's start."""

    index: int
    sent_at_s: float  # the first try
    connected_at_s: float | None = None  # the try that reached the gateway
    ended_at_s: float | None = None
    connect_retries: int = 0
    status: str | None = None  # COMPLETED, FAILED or HUNG
    http_status: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    text: str = ""
    completion_tokens: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    # speculation, from the final chunk's `augury` block (0 when it never came)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps_by_draft: dict[str, int] = field(default_factory=dict)  # draft model -> steps drafted

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Received:
        data = dict(data)
        data["chunks"] = [Chunk(**chunk) for chunk in data.get("chunks", [])]
        return cls(**data)


def request_body(request: ChaosRequest, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


@dataclass
class Replay:
    """Sends requests open loop: each at its `send_at_s` whatever the others are doing."""

    base_url: str
    model: str
    hang_s: float
    connect_timeout_s: float
    on_done: Callable[[Received], None] = lambda received: None
    start: float = field(default_factory=time.monotonic)
    streaming: set[int] = field(default_factory=set)  # requests with output, not ended

    def now(self) -> float:
        return time.monotonic() - self.start

    async def run(self, requests: Sequence[ChaosRequest]) -> list[Received]:
        # no keep-alive: a pooled connection to a killed gateway must not take a new request
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks = []
            try:
                for request in sorted(requests, key=lambda r: r.send_at_s):
                    delay = request.send_at_s - self.now()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    send = self.send(session, request)
                    tasks.append(asyncio.create_task(send, name=f"chaos-{request.index}"))
                done = await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
        return sorted(done, key=lambda r: r.index)

    async def send(self, session: aiohttp.ClientSession, request: ChaosRequest) -> Received:
        received = Received(request.index, sent_at_s=self.now())
        body = request_body(request, self.model)
        try:
            await self._connect_and_stream(session, body, received)
            received.status = COMPLETED
        except TimeoutError:
            received.status = HUNG
            received.error = f"nothing from the server for {self.hang_s:g} s"
        except RequestFailed as error:
            received.status = FAILED
            received.error = str(error)
        except (aiohttp.ClientError, OSError) as error:
            received.status = FAILED
            received.error = f"connection error: {error!r}"
        received.ended_at_s = self.now()
        self.on_done(received)
        return received

    async def _connect_and_stream(
        self, session: aiohttp.ClientSession, body: dict[str, Any], received: Received
    ) -> None:
        url = f"{self.base_url}{PATH}"
        while True:
            attempt_at = self.now()
            try:
                async with asyncio.timeout(self.hang_s):
                    response = await session.post(url, json=body)
            except aiohttp.ClientConnectorError as error:
                # refused: nothing listens (the gateway is down); the request never reached it
                if self.now() - received.sent_at_s > self.connect_timeout_s:
                    raise RequestFailed(
                        f"could not connect for {self.connect_timeout_s:g} s: {error}"
                    ) from None
                received.connect_retries += 1
                await asyncio.sleep(RETRY_S)
                continue
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                # connected, then the connection broke while the request was written: it reached
                # a gateway (one killed at that moment dies under the request's body)
                received.connected_at_s = attempt_at
                raise
            received.connected_at_s = attempt_at
            try:
                async with response:
                    received.http_status = response.status
                    await raise_for_status(response)
                    await self._stream(response, received)
            finally:
                self.streaming.discard(received.index)
            return

    async def _stream(self, response: aiohttp.ClientResponse, received: Received) -> None:
        async for event in stream_events(response, idle_s=self.hang_s):
            apply_event(received, event, self.now())
            if received.chunks:
                self.streaming.add(received.index)
        if received.finish_reason is None:
            raise RequestFailed("the stream ended without a finish_reason")


def apply_event(received: Received, event: dict[str, Any], now: float) -> None:
    """Fold one streamed event into what the client received."""
    raise_error_event(event)
    text = ""
    for choice in event.get("choices") or []:
        text += str(choice.get("text") or "")
        if choice.get("finish_reason") is not None:
            received.finish_reason = str(choice["finish_reason"])
    statistics = event.get("augury")
    if isinstance(statistics, dict):
        received.draft_tokens = int(statistics.get("draft_tokens") or 0)
        received.accepted_tokens = int(statistics.get("accepted_tokens") or 0)
        steps = statistics.get("steps_by_draft")
        if isinstance(steps, dict):
            received.steps_by_draft = {str(k): int(v) for k, v in steps.items()}
    usage = event.get("usage")
    tokens = received.completion_tokens
    if isinstance(usage, dict):
        tokens = int(usage.get("completion_tokens") or 0)
    if event.get("choices"):
        received.chunks.append(Chunk(now, tokens, text))
    received.text += text
    received.completion_tokens = max(received.completion_tokens, tokens)
