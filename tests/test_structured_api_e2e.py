"""Structured output and tool calls through the HTTP API on the whole stack (gateway, scheduler,
verifier, drafter; SmolLM2 target), with speculation on: JSON-schema outputs parse and validate,
greedy and sampled; greedy constrained output with speculation equals it without; a required
tool call is well formed and validates, whole and streamed as the official client reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import AsyncOpenAI

from services.run import start_stack
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from tests.test_services_openai import free_port, smollm2_models, wait_for_gateway
from tests.test_services_support import make_settings

pytestmark = [pytest.mark.anyio, pytest.mark.smollm2]
__all__ = ["smollm2_models"]  # the fixture, shared with test_services_openai

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
PERSON_ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, role, city."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 160


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def person(client: AsyncOpenAI, model: str, **options: Any) -> tuple[str, str | None]:
    answer = await client.chat.completions.create(
        model=model,
        messages=PERSON_ASK,  # type: ignore[arg-type]
        max_completion_tokens=MAX_TOKENS,
        response_format={  # type: ignore[arg-type]
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        **options,
    )
    choice = answer.choices[0]
    return choice.message.content or "", choice.finish_reason


async def test_json_schema_and_required_tool_calls_under_speculation(
    server: EmbeddedRedis, smollm2_models: ModelPaths, tmp_path: Path
) -> None:
    port = free_port()
    settings = make_settings(
        server.url,
        "structured",
        engine={"block_size": 16, "kv_memory_bytes": 64 << 20},
        # a slow or stalled CI machine is not a failure; a hang still is, after 5 minutes
        gateway={"port": port, "output_idle_timeout_s": 300},
        models={"target_dir": smollm2_models.target},
    )
    stack = await start_stack(settings, server.url, smollm2_models)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = settings.gateway.model_name
    speculate = {"augury": {"speculate": True}}
    try:
        await wait_for_gateway(client)
        assert stack.scheduler is not None
        drafts_before = stack.scheduler.stats.acceptance.num_drafts

        # JSON schema, greedy: parses, validates, and equals plain constrained decoding
        greedy, finish = await person(client, model, temperature=0, extra_body=speculate)
        assert finish == "stop", greedy
        jsonschema.validate(json.loads(greedy), PERSON)
        assert stack.scheduler.stats.acceptance.num_drafts > drafts_before  # speculated
        plain, _ = await person(
            client, model, temperature=0, extra_body={"augury": {"speculate": False}}
        )
        assert plain == greedy
        # sampled
        for seed in (1, 2):
            sampled, finish = await person(
                client, model, temperature=1.0, seed=seed, extra_body=speculate
            )
            assert finish == "stop", sampled
            jsonschema.validate(json.loads(sampled), PERSON)

        # a required tool call: well formed, its arguments valid
        answer = await client.chat.completions.create(
            model=model,
            messages=WEATHER_ASK,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=speculate,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        parameters = WEATHER["function"]["parameters"]  # type: ignore[index]
        jsonschema.validate(json.loads(call.function.arguments), parameters)

        # ... and streamed, assembled by the client
        async with client.chat.completions.stream(
            model=model,
            messages=WEATHER_ASK,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=speculate,
        ) as stream:
            final = await stream.get_final_completion()
        streamed = final.choices[0]
        assert streamed.finish_reason == "tool_calls"
        (call,) = streamed.message.tool_calls or []
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), parameters)
    finally:
        await client.close()
        await stack.stop()
