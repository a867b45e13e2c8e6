"""The benchmarks' SSE client against a real aiohttp server streaming canned answers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tools.sse import RequestFailed, event_data, raise_error_event, raise_for_status, stream_events

pytestmark = pytest.mark.anyio

ANSWER = (
    b": a comment\n\n"
    b'data: {"choices": [{"text": "a"}]}\n\n'
    b"event: ping\n\n"
    b'data:{"choices": [{"text": "b"}]}\r\n\r\n'
    b"data: [DONE]\n\n"
    b'data: {"after": "done"}\n\n'
)


def test_data_lines_are_told_from_other_sse_lines() -> None:
    assert event_data(b'data: {"a": 1}\n') == b'{"a": 1}'
    assert event_data(b"data:[DONE]\r\n") == b"[DONE]"
    assert event_data(b"\n") is None
    assert event_data(b": keep-alive\n") is None
    assert event_data(b"event: error\n") is None


def test_error_events_raise() -> None:
    raise_error_event({"choices": []})
    with pytest.raises(RequestFailed, match="error event: overloaded"):
        raise_error_event({"error": {"message": "overloaded"}})
    with pytest.raises(RequestFailed, match="error event: gone"):
        raise_error_event({"error": "gone"})


def app_with(handler: Callable[[web.Request], Any]) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    return app


async def events_of(app: web.Application, idle_s: float | None = None) -> list[dict[str, Any]]:
    async with (
        TestServer(app) as server,
        aiohttp.ClientSession() as session,
        session.post(server.make_url("/v1/completions"), json={}) as response,
    ):
        await raise_for_status(response)
        return [event async for event in stream_events(response, idle_s)]


def streamed(body: bytes, hang_s: float = 0.0) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body)
        if hang_s:
            await asyncio.sleep(hang_s)
        return response

    return handler


async def test_events_up_to_done_skipping_other_lines() -> None:
    events = await events_of(app_with(streamed(ANSWER)))
    assert events == [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]


async def test_a_closed_connection_ends_the_events() -> None:
    events = await events_of(app_with(streamed(b'data: {"n": 1}\n\n')))
    assert events == [{"n": 1}]


async def test_malformed_events_raise() -> None:
    with pytest.raises(RequestFailed, match="malformed stream event"):
        await events_of(app_with(streamed(b"data: {not json\n\n")))
    with pytest.raises(RequestFailed, match="malformed stream event"):
        await events_of(app_with(streamed(b"data: [1, 2]\n\n")))


async def test_a_silent_stream_times_out() -> None:
    with pytest.raises(TimeoutError):
        await events_of(app_with(streamed(b'data: {"n": 1}\n\n', hang_s=5.0)), idle_s=0.2)


async def test_error_statuses_raise_with_the_servers_message() -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "top_p must be in (0, 1]"}}, status=400)

    async def crash(request: web.Request) -> web.Response:
        return web.Response(text="  upstream exploded  ", status=502)

    with pytest.raises(RequestFailed, match=r"HTTP 400: top_p must be in \(0, 1\]"):
        await events_of(app_with(refuse))
    with pytest.raises(RequestFailed, match="HTTP 502: upstream exploded"):
        await events_of(app_with(crash))
