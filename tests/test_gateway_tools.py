"""Structured output and tool calls at the gateway: what reaches the scheduler (the constraint,
the prompt with its tools), 400s that name the field, and tool calls as the official `openai`
client reads them, whole and streamed. A stand-in scheduler answers with a scripted text."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from services.gateway.app import Gateway
from shared.bus import Bus, Delivery, EmbeddedRedis, StreamConsumer
from shared.grammar.spec import check_structured
from shared.model.smollm2 import ensure_smollm2
from shared.settings import AugurySettings, GatewaySettings, RedisSettings
from shared.values.sampling import StructuredOutput
from shared.wire import Cancel, FinishReason, Submit, Tokens
from shared.wire.streams import SCHEDULER, requests_stream
from tests.test_tool_calls import ADD, WEATHER

pytestmark = pytest.mark.anyio
MODEL = GatewaySettings().model_name
FAST = RedisSettings(block_ms=100, claim_idle_ms=1000)
CALLS = (
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": [3]}}\n</tool_call>'
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "tags": {"type": "array"}},
    "required": ["answer"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris, and 2 + 3?"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2())


class ScriptedScheduler:
    """Answers each Submit with `reply`, two tokens per message, ending with STOP."""

    def __init__(self, bus: Bus, tokenizer: Any) -> None:
        self.bus, self.tokenizer = bus, tokenizer
        self.reply = "Hello."
        self.submits: list[Submit] = []

    async def __call__(self, delivery: Delivery) -> None:
        message = delivery.message
        if isinstance(message, Cancel):
            return
        assert isinstance(message, Submit)
        self.submits.append(message)
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        steps = [ids[i : i + 2] for i in range(0, len(ids), 2)]
        replies = [
            Tokens(
                message.request_id,
                i,
                2 * i,
                tuple(step),
                FinishReason.STOP if i == len(steps) - 1 else None,
            )
            for i, step in enumerate(steps)
        ]
        await self.bus.publish_all([(message.reply_to, reply) for reply in replies])

    def prompt(self) -> str:
        return str(self.tokenizer.decode(self.submits[-1].prompt))


@pytest.fixture
async def running(
    server: EmbeddedRedis, tokenizer: Any, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[TestClient, ScriptedScheduler, AsyncOpenAI]]:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:40]
    gateway = getattr(request, "param", {})
    settings = AugurySettings(
        redis=FAST, gateway=GatewaySettings(**gateway), service={"cell": f"t-{name}"}
    )
    scheduler = ScriptedScheduler(Bus(server.url, settings.redis, f"{name}-sched"), tokenizer)
    consumer = StreamConsumer(
        scheduler.bus,
        group=SCHEDULER,
        streams=[requests_stream(f"t-{name}")],
        handler=scheduler,
        concurrency=4,
    )
    bus = Bus(server.url, settings.redis, name)
    app = Gateway(settings, bus, tokenizer, vocab_size=len(tokenizer), max_context=2048)
    client = TestClient(TestServer(app.app()))
    await client.start_server()
    await consumer.start()
    sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    yield client, scheduler, sdk
    await consumer.stop()
    await client.close()
    await scheduler.bus.close()


Running = tuple[TestClient, ScriptedScheduler, AsyncOpenAI]


# ---- structured output: what reaches the scheduler --------------------------------------------
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            StructuredOutput("json_schema", json.dumps(SCHEMA)),
        ),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]{3}"}, StructuredOutput("regex", "[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]')),
        ({"structured_outputs": {"choice": ["a"]}}, StructuredOutput("choice", '["a"]')),
    ],
)
async def test_constraints_reach_the_scheduler(
    running: Running, fields: dict[str, Any], expected: StructuredOutput | None
) -> None:
    client, scheduler, _ = running
    body = {"model": MODEL, "messages": ASK, **fields}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    assert scheduler.submits[-1].sampling.structured == expected


async def test_a_gbnf_grammar_is_converted_to_lark(running: Running) -> None:
    client, scheduler, _ = running
    body = {"model": MODEL, "prompt": "x", "guided_grammar": 'root ::= "yes" | "no"'}
    assert (await client.post("/v1/completions", json=body)).status == 200
    structured = scheduler.submits[-1].sampling.structured
    assert structured is not None and structured.kind == "grammar"
    assert "start:" in structured.spec
    check_structured(structured)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "guided_regex",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
async def test_bad_constraints_and_tools_are_400s_naming_the_field(
    running: Running, fields: dict[str, Any], param: str
) -> None:
    client, scheduler, _ = running
    response = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **fields}
    )
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["param"] == param, error
    assert scheduler.submits == []


@pytest.mark.parametrize("running", [{"structured_compile_timeout_s": 1e-9}], indirect=True)
async def test_a_grammar_that_compiles_too_slowly_is_a_400(running: Running) -> None:
    client, scheduler, _ = running
    body = {"model": MODEL, "messages": ASK, "guided_regex": "[a-z]{1,50}@[a-z]{1,50}"}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 400
    assert "did not compile within" in (await response.json())["error"]["message"]
    assert scheduler.submits == []


# ---- tools -------------------------------------------------------------------------------------
async def test_required_calls_are_constrained_and_answered_in_openais_format(
    running: Running,
) -> None:
    _, scheduler, sdk = running
    scheduler.reply = CALLS
    answer = await sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, ADD],
        tool_choice="required",  # type: ignore[list-item]
    )
    structured = scheduler.submits[-1].sampling.structured
    assert structured is not None and structured.kind == "grammar"
    check_structured(structured)  # compiles: the engine can enforce it
    assert "get_weather" in scheduler.prompt() and "<tool_call>" in scheduler.prompt()
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)


async def test_auto_calls_stream_as_openai_streams_them(running: Running) -> None:
    _, scheduler, sdk = running
    scheduler.reply = "Let me check.\n" + CALLS
    async with sdk.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, ADD],  # type: ignore[list-item]
    ) as stream:
        chunks = [event.chunk async for event in stream if event.type == "chunk"]
        final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("add", {"a": 2, "b": [3]}),
    ]
    assert scheduler.submits[-1].sampling.structured is None  # auto: the model chooses
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    opening = deltas[0].tool_calls[0]  # type: ignore[index]
    assert opening.index == 0 and opening.id == calls[0].id
    assert opening.function is not None and opening.function.name == "get_weather"
    assert opening.function.arguments == ""


async def test_a_named_call_and_tool_results_in_the_conversation(running: Running) -> None:
    client, scheduler, _ = running
    scheduler.reply = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>'
    )
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    named = {"type": "function", "function": {"name": "add"}}
    body = {"model": MODEL, "messages": messages, "tools": [WEATHER, ADD], "tool_choice": named}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    prompt = scheduler.prompt()
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt
    structured = scheduler.submits[-1].sampling.structured
    assert structured is not None and '"const": "add"' in structured.spec
    assert '"const": "get_weather"' not in structured.spec  # named: that function alone
    (choice,) = (await response.json())["choices"]
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": [2, 3]}'


async def test_tool_choice_none_leaves_tools_out(running: Running) -> None:
    _, scheduler, sdk = running
    scheduler.reply = CALLS  # whatever the model writes is content
    answer = await sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="none",  # type: ignore[list-item]
    )
    assert "get_weather" not in scheduler.prompt()
    assert answer.choices[0].message.content == CALLS
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls


async def test_the_sdk_sees_bad_tools_as_bad_requests(running: Running) -> None:
    _, _, sdk = running
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        await sdk.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )


async def test_forced_call_arguments_stream_in_pieces(running: Running) -> None:
    _, scheduler, sdk = running
    scheduler.reply = CALLS  # two tokens per message from the scheduler
    async with sdk.chat.completions.stream(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, ADD],  # type: ignore[list-item]
        tool_choice="required",
    ) as stream:
        chunks = [event.chunk async for event in stream if event.type == "chunk"]
        final = await stream.get_final_completion()
    pieces = [
        call
        for chunk in chunks
        if chunk.choices and chunk.choices[0].delta.tool_calls
        for call in chunk.choices[0].delta.tool_calls
    ]
    first = [p for p in pieces if p.index == 0]
    assert first[0].id is not None and first[0].function is not None
    assert first[0].function.name == "get_weather"
    fragments = [p.function.arguments for p in first[1:] if p.function is not None]
    assert len(fragments) > 1 and all(p.id is None for p in first[1:])  # as it was written
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert "".join(f or "" for f in fragments) == calls[0].function.arguments
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris", "unit": "c"},
        {"a": 2, "b": [3]},
    ]
