"""The benchmarks' one SSE client: a streamed OpenAI answer as a sequence of JSON events.

`stream_events(response)` reads a streamed `/v1/...` answer line by line and yields each `data:`
event decoded; it stops at `data: [DONE]` or when the connection closes, and skips blank
separators, comments and other SSE fields. With `idle_s` it raises TimeoutError when no line
arrives for that long (a hung stream). Failures the server reports (an HTTP error status, an
`error` event) and malformed events raise `RequestFailed` with the message a record keeps.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

DONE = b"[DONE]"
MAX_QUOTED_BYTES = 200  # of a malformed event, in its error message
MAX_ERROR_CHARS = 500  # of a non-JSON error body


class RequestFailed(Exception):
    """One request's failure, with the message its record keeps."""


def event_data(line: bytes) -> bytes | None:
    """The payload of a `data:` line, stripped; None for any other line."""
    data = line.strip()
    if not data.startswith(b"data:"):
        return None
    return data[len(b"data:") :].strip()


def decode_event(data: bytes) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except ValueError:
        raise RequestFailed(f"malformed stream event: {data[:MAX_QUOTED_BYTES]!r}") from None
    if not isinstance(event, dict):
        raise RequestFailed(f"malformed stream event: {data[:MAX_QUOTED_BYTES]!r}")
    return event


def raise_error_event(event: Mapping[str, Any]) -> None:
    """An `error` event (the server gave up on the request mid-stream) as RequestFailed."""
    if "error" in event:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise RequestFailed(f"error event: {message}")


async def error_text(response: aiohttp.ClientResponse) -> str:
    """An error answer's message: OpenAI's `error.message`, else the body's start."""
    text = await response.text()
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:MAX_ERROR_CHARS] or response.reason or "no message"


async def raise_for_status(response: aiohttp.ClientResponse) -> None:
    if response.status >= 400:
        raise RequestFailed(f"HTTP {response.status}: {await error_text(response)}")


async def stream_events(
    response: aiohttp.ClientResponse, idle_s: float | None = None
) -> AsyncIterator[dict[str, Any]]:
    """The answer's events, up to `[DONE]` or the end of the connection."""
    while True:
        async with asyncio.timeout(idle_s):
            line = await response.content.readline()
        if not line:
            return  # the connection closed
        data = event_data(line)
        if data is None:
            continue
        if data == DONE:
            return
        yield decode_event(data)
