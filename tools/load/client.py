"""The open-loop replay client: a trace's requests sent to an OpenAI-compatible server on the
trace's schedule, each answer streamed back into a `RequestRecord`.

Open loop: request i leaves at `arrival_s / rate_scale` after the start whatever the others
are doing, so a slow server sees the load pile up as it would in production. Each request is a
streamed `POST /v1/chat/completions` with vLLM's `continuous_usage_stats`, so every chunk says
how many tokens have been generated so far and the record's `chunks` count tokens exactly;
`ignore_eos` with `max_tokens` = the trace's output length makes the server generate that many.
A trace's `tpot_slo_ms` goes as `augury.tpot_slo_ms`; its `slo_class` goes as
`augury.slo_class` only when the trace gives no `tpot_slo_ms` (the server must then know the
class). With both, the class only labels the request in the report, so a synthesized trace's
made-up classes (`tools.traces synth --slo tight=60`) need no matching server classes. Its `app`
goes as `augury.app`.
A request that fails (an HTTP error, an `error` event mid-stream, a dropped connection, no
answer within `request_timeout_s`) becomes a failed record; `replay` itself does not raise for
one request's failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from tools.load.records import RequestRecord
from tools.load.trace import TraceRequest
from tools.sse import RequestFailed, raise_error_event, raise_for_status, stream_events

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
DEFAULT_TEMPERATURE = 0.0  # greedy unless the trace says otherwise
SPECULATION_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


class ReplayError(RuntimeError):
    """The replay cannot start at all (e.g. the server names no model)."""


def api_root(base_url: str) -> str:
    """The server's root: `http://h:8000/v1/` and `http://h:8000` both give `http://h:8000`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def schedule(
    requests: Sequence[TraceRequest],
    *,
    rate_scale: float = 1.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
) -> list[tuple[int, float]]:
    """(trace index, send time in s from the start) of the requests to send, in send order."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be positive, got {rate_scale}")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    plan = []
    for index in order:
        send_at = max(0.0, requests[index].arrival_s / rate_scale)
        if duration_s is not None and send_at > duration_s:
            break
        if max_requests is not None and len(plan) >= max_requests:
            break
        plan.append((index, send_at))
    return plan


def request_body(request: TraceRequest, model: str) -> dict[str, Any]:
    """The chat completion request for one trace request (RequestFailed without a prompt)."""
    if request.messages is not None:
        messages = [{"role": role, "content": text} for role, text in request.messages]
    elif request.prompt is not None:
        messages = [{"role": "user", "content": request.prompt}]
    else:
        raise RequestFailed("the trace request has no prompt or messages (fill it first)")
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": (
            DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
        ),
        "priority": request.priority,
    }
    if request.num_output_tokens is not None:
        body["max_tokens"] = request.num_output_tokens
        body["ignore_eos"] = True
    augury: dict[str, object] = {}
    if request.tpot_slo_ms is not None:
        augury["tpot_slo_ms"] = request.tpot_slo_ms
    elif request.slo_class is not None:
        augury["slo_class"] = request.slo_class
    if request.app is not None:
        augury["app"] = request.app
    if augury:
        body["augury"] = augury
    return body


@dataclass
class _Tally:
    """Completed and failed requests so far, shown on the progress bar."""

    bar: tqdm
    completed: int = 0
    failed: int = 0

    def count(self, task: asyncio.Task[RequestRecord]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        if task.result().is_completed:
            self.completed += 1
        else:
            self.failed += 1
        self.bar.set_postfix(completed=self.completed, failed=self.failed, refresh=False)
        self.bar.update()


async def replay(
    requests: Sequence[TraceRequest],
    base_url: str,
    *,
    rate_scale: float = 1.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    model: str | None = None,
    api_key: str | None = None,
    request_timeout_s: float = 600,
    show_progress: bool = True,
) -> list[RequestRecord]:
    """Send the requests on their schedule; the records of those sent, in trace order.

    Sending stops after `duration_s` (of the scaled schedule) or `max_requests`; then the
    requests in flight are awaited, each for at most `request_timeout_s` after it was sent.
    `model` None: the first model the server lists. Raises ReplayError only when no model
    can be found.
    """
    plan = schedule(
        requests, rate_scale=rate_scale, duration_s=duration_s, max_requests=max_requests
    )
    root = api_root(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # every planned request may be open at once: the connector must not queue them
    connector = aiohttp.TCPConnector(limit=max(100, len(plan)))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=timeout
    ) as session:
        chosen = model if model is not None else await served_model(session, root)
        with tqdm(total=len(plan), unit="req", disable=not show_progress) as bar:
            tally = _Tally(bar)
            records = await _send_all(
                session, f"{root}{CHAT_PATH}", requests, plan, chosen, request_timeout_s, tally
            )
    return sorted(records, key=lambda r: r.index)


async def served_model(session: aiohttp.ClientSession, root: str) -> str:
    """The id of the first model the server lists."""
    try:
        async with session.get(f"{root}{MODELS_PATH}") as response:
            if response.status >= 400:
                raise ReplayError(f"{root}{MODELS_PATH} answered HTTP {response.status}")
            listing = await response.json()
        return str(listing["data"][0]["id"])
    except (aiohttp.ClientError, OSError, ValueError, KeyError, IndexError, TypeError) as error:
        raise ReplayError(f"could not find the served model at {root}: {error}") from None


async def _send_all(
    session: aiohttp.ClientSession,
    url: str,
    requests: Sequence[TraceRequest],
    plan: Sequence[tuple[int, float]],
    model: str,
    timeout_s: float,
    tally: _Tally,
) -> list[RequestRecord]:
    start = time.monotonic()
    tasks: list[asyncio.Task[RequestRecord]] = []
    try:
        for index, send_at in plan:
            delay = start + send_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            send = _send(session, url, index, requests[index], send_at, start, model, timeout_s)
            task = asyncio.create_task(send, name=f"replay-{index}")
            task.add_done_callback(tally.count)
            tasks.append(task)
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    request: TraceRequest,
    send_at: float,
    start: float,
    model: str,
    timeout_s: float,
) -> RequestRecord:
    record = RequestRecord(
        index=index,
        arrival_s=send_at,
        num_prompt_tokens=request.input_length or 0,
        kind=request.kind,
        slo_class=request.slo_class,
        tpot_slo_ms=request.tpot_slo_ms,
    )
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(session, url, request_body(request, model), record, start)
    except RequestFailed as error:
        _fail(record, str(error), start)
    except TimeoutError:
        _fail(record, f"no complete answer within {timeout_s:g} s", start)
    except (aiohttp.ClientError, OSError) as error:
        _fail(record, f"connection error: {error!r}", start)
    except Exception as error:  # one request's surprise must not lose the others' records
        _fail(record, f"{type(error).__name__}: {error}", start)
    return record


def _fail(record: RequestRecord, message: str, start: float) -> None:
    record.error = message
    record.finish_reason = None
    record.finish_s = time.monotonic() - start


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    start: float,
) -> None:
    async with session.post(url, json=body) as response:
        await raise_for_status(response)
        async for event in stream_events(response):
            apply_event(record, event, time.monotonic() - start)
    if record.finish_reason is None:
        raise RequestFailed("the stream ended without a finish_reason")
    record.finish_s = time.monotonic() - start


def apply_event(record: RequestRecord, event: dict[str, Any], now: float) -> None:
    """Fold one streamed chunk into the record (`now`: seconds since the start)."""
    raise_error_event(event)
    for choice in event.get("choices") or []:
        if _has_text(choice) and record.first_token_s is None:
            record.first_token_s = now  # a server without usage per chunk still shows text
        if choice.get("finish_reason") is not None:
            record.finish_reason = str(choice["finish_reason"])
    usage = event.get("usage")
    if isinstance(usage, dict):
        _apply_usage(record, usage, now)
    acceptance = event.get("augury")
    if isinstance(acceptance, dict):
        _apply_acceptance(record, acceptance)


def _has_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return bool(content)


def _apply_usage(record: RequestRecord, usage: dict[str, Any], now: float) -> None:
    record.num_prompt_tokens = int(usage.get("prompt_tokens") or record.num_prompt_tokens)
    completion = int(usage.get("completion_tokens") or 0)
    fresh = completion - record.num_output_tokens
    if fresh > 0:
        record.chunks.append((now, fresh))
        record.num_output_tokens = completion
        if record.first_token_s is None:
            record.first_token_s = now


def _apply_acceptance(record: RequestRecord, acceptance: dict[str, Any]) -> None:
    for name in SPECULATION_COUNTERS:
        setattr(record, name, int(acceptance.get(name) or 0))
    steps = acceptance.get("steps_by_draft")
    if isinstance(steps, dict):
        record.steps_by_draft = {str(model): int(n) for model, n in steps.items()}
