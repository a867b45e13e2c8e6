"""What real clients send, against the gateway and the stand-in scheduler of the gateway tests:
stop strings cut inside one step's tokens (and cancel the request), n choices, echo, the default
max_tokens, and the fields that are refused by name."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from openai import AsyncOpenAI

from services.gateway.choices import choice_seed
from shared.bus import EmbeddedRedis
from tests.test_gateway import (
    REPLY,
    StandInScheduler,
    anyio_backend,
    model_name,
    running,
    sse_events,
    start,
    tokenizer,
)

__all__ = ["anyio_backend", "running", "tokenizer"]  # fixtures shared with the gateway tests

pytestmark = pytest.mark.anyio
CONTEXT = 2048  # the stand-in gateway's max_context


async def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    return await client.post(path, json={"model": model_name(), **body})


async def cancelled(scheduler: StandInScheduler, count: int = 1) -> list[str]:
    for _ in range(100):
        if len(scheduler.cancelled) >= count:
            break
        await asyncio.sleep(0.05)
    return scheduler.cancelled


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_string_inside_one_step_ends_the_output_there(
    running: tuple[TestClient, StandInScheduler], include: bool
) -> None:
    client, scheduler = running
    stop = "world, f"  # several tokens of the stand-in's second step, across their boundaries
    body = {"prompt": "Say hello", "stop": [stop, "never"], "include_stop_str_in_output": include}
    response = await post(client, "/v1/completions", body)
    assert response.status == 200, await response.text()
    out = await response.json()
    cut = REPLY.index(stop) + (len(stop) if include else 0)
    (choice,) = out["choices"]
    assert choice["text"] == REPLY[:cut]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    taken = tokenizer_len(scheduler, REPLY[: REPLY.index(stop) + len(stop)])
    assert out["usage"]["completion_tokens"] == taken < len(scheduler.reply_ids)
    (submit,) = scheduler.submits
    assert await cancelled(scheduler) == [submit.request_id]  # the scheduler stops working


def tokenizer_len(scheduler: StandInScheduler, text: str) -> int:
    """How many of the stand-in's reply tokens it takes to complete `text`."""
    ids = scheduler.reply_ids
    return next(
        n for n in range(len(ids) + 1) if scheduler.tokenizer.decode(ids[:n]).startswith(text)
    )


async def test_streamed_chunks_never_hold_text_past_a_stop(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    stop = "from the"
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "stop": stop,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await post(client, "/v1/chat/completions", body)
    events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(pieces) == REPLY[: REPLY.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert len(await cancelled(scheduler)) == 1


async def test_a_reply_without_the_stop_string_comes_whole(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    body = {"prompt": "Say hello", "stop": "scheduler!?", "stream": True}  # a prefix is held...
    events = await sse_events(await post(client, "/v1/completions", body))
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == REPLY  # ... and released at the end
    assert events[-2]["choices"][0]["stop_reason"] is None
    await asyncio.sleep(0.2)
    assert scheduler.cancelled == []  # finished by itself: nothing to cancel


async def test_n_choices_fan_out_with_derived_seeds(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    body = {"prompt": "Say hello", "n": 3, "best_of": 3, "temperature": 0.8, "seed": 7}
    out = await (await post(client, "/v1/completions", body)).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["text"] == REPLY for c in out["choices"])
    ids = [s.request_id for s in scheduler.submits]
    assert sorted(ids) == [f"{out['id']}-{i}" for i in range(3)]
    seeds = {s.request_id: s.sampling.seed for s in scheduler.submits}
    assert [seeds[f"{out['id']}-{i}"] for i in range(3)] == [choice_seed(7, i) for i in range(3)]
    assert len(set(seeds.values())) == 3 and seeds[f"{out['id']}-0"] == 7
    assert out["usage"]["completion_tokens"] == 3 * len(scheduler.reply_ids)
    assert out["augury"]["drafts"] == 3 and out["augury"]["steps_by_draft"] == {"draft-s": 3}

    streamed = {**body, "stream": True, "stop": "world"}
    events = await sse_events(await post(client, "/v1/completions", streamed))
    texts = ["", "", ""]
    finishes: list[int] = []
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes.append(choice["index"])
    assert texts == [REPLY[: REPLY.index("world")]] * 3 and sorted(finishes) == [0, 1, 2]
    assert len(await cancelled(scheduler, 3)) == 3  # each choice stopped in the scheduler


async def test_echo_puts_the_prompt_first(running: tuple[TestClient, StandInScheduler]) -> None:
    client, _ = running
    out = await (await post(client, "/v1/completions", {"prompt": "Say hi", "echo": True})).json()
    assert out["choices"][0]["text"] == "Say hi" + REPLY
    body = {"prompt": "Say hi", "echo": True, "stream": True}
    events = await sse_events(await post(client, "/v1/completions", body))
    assert events[0]["choices"][0]["text"] == "Say hi"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Say hi" + REPLY


async def test_default_max_tokens_is_the_rest_of_the_context(
    running: tuple[TestClient, StandInScheduler], tokenizer: Any
) -> None:
    client, scheduler = running
    assert (await post(client, "/v1/completions", {"prompt": "Say hello"})).status == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert (await post(client, "/v1/chat/completions", chat)).status == 200
    completion, conversation = scheduler.submits
    assert completion.sampling.max_tokens == CONTEXT - len(tokenizer.encode("Say hello"))
    assert conversation.sampling.max_tokens == CONTEXT - len(conversation.prompt)
    full = await post(client, "/v1/completions", {"prompt": [5] * CONTEXT})
    assert full.status == 400 and (await full.json())["error"]["code"] == "context_length_exceeded"


async def test_a_setting_lowers_the_default_max_tokens(
    server: EmbeddedRedis, tokenizer: Any
) -> None:
    client, scheduler, consumer = await start(server, tokenizer, "lower", default_max_tokens=100)
    try:
        assert (await post(client, "/v1/completions", {"prompt": "Hi"})).status == 200
        explicit = {"prompt": "Hi", "max_tokens": 300}  # an explicit value is the client's
        assert (await post(client, "/v1/completions", explicit)).status == 200
        assert [s.sampling.max_tokens for s in scheduler.submits] == [100, 300]
    finally:
        await consumer.stop()
        await client.close()
        await scheduler.bus.close()


async def test_top_k_minus_one_is_off(running: tuple[TestClient, StandInScheduler]) -> None:
    client, scheduler = running
    body = {"prompt": "x", "top_k": -1, "temperature": 0.5}
    assert (await post(client, "/v1/completions", body)).status == 200
    assert scheduler.submits[-1].sampling.top_k == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"augury": {"speculat": False}}, "augury.speculat"),
        ("/v1/completions", {"guided_json": {"type": "bogus"}}, "guided_json"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", {"guided_regex": "a("}, "guided_regex"),
        ("/v1/completions", {"guided_grammar": "root ::= ("}, "guided_grammar"),
        ("/v1/completions", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"stop": [""]}, "stop"),
        ("/v1/completions", {"stop": ["x" * 257]}, "stop"),
        ("/v1/completions", {"stop": [1]}, "stop"),
        ("/v1/completions", {"top_k": -2}, "top_k"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
    ],
)
async def test_refused_fields_are_named(
    running: tuple[TestClient, StandInScheduler], path: str, body: dict[str, Any], param: str
) -> None:
    client, scheduler = running
    chat = {"messages": [{"role": "user", "content": "x"}]}
    prompt = {"prompt": "x"} if path == "/v1/completions" else chat
    response = await post(client, path, {**prompt, **body})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == param, error
    assert param.split(".")[-1] in error["message"]
    assert scheduler.submits == []


async def test_the_openai_client_sends_stop_n_and_echo(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, _ = running
    openai = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        out = await openai.completions.create(
            model=model_name(), prompt="Hi", n=2, stop=["world"], echo=True, temperature=0
        )
        assert [c.text for c in out.choices] == ["Hi" + REPLY[: REPLY.index("world")]] * 2
        assert [c.finish_reason for c in out.choices] == ["stop", "stop"]
        stream = await openai.chat.completions.create(
            model=model_name(),
            messages=[{"role": "user", "content": "Hi"}],
            stop="stand",
            n=2,
            stream=True,
            extra_body={"include_stop_str_in_output": True},
        )
        texts = ["", ""]
        async for part in stream:
            for choice in part.choices:
                texts[choice.index] += choice.delta.content or ""
        assert texts == [REPLY[: REPLY.index("stand") + len("stand")]] * 2
    finally:
        await openai.close()


async def test_a_client_leaving_cancels_every_choice(
    running: tuple[TestClient, StandInScheduler],
) -> None:
    client, scheduler = running
    body = {"messages": [{"role": "user", "content": "hang"}], "n": 2, "stream": True}
    response = await post(client, "/v1/chat/completions", body)
    await response.content.readline()  # a role chunk: choice 0 is in flight
    response.close()
    # choice 1 waits for choice 0's prefill (shared through the prefix cache): never submitted
    assert await cancelled(scheduler, 1) == [s.request_id for s in scheduler.submits]
    assert len(scheduler.submits) == 1 and scheduler.submits[0].request_id.endswith("-0")
