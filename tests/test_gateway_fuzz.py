"""Fuzzing the HTTP API: whatever a client sends, the answer is a 2xx or a 4xx with an OpenAI-style
error (never a 5xx, never a hang), and the gateway still serves a good request afterwards.

Bodies are drawn from a seeded grammar: every field the API knows (and a few it does not), each
with values of every JSON type, extremes included (NaN, infinities, 1e-320, huge integers, long
strings, deep nesting); and raw bodies that are not JSON at all. The stand-in scheduler of the
gateway tests answers what passes.

CI runs 300 bodies; `AUGURY_FUZZ_SCALE=N` runs N times as many (the full form, with the wire
fuzz, in docs/reliability.md):
    AUGURY_FUZZ_SCALE=20 .venv/bin/python -m pytest -s tests/test_gateway_fuzz.py \
        tests/test_wire_fuzz.py
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from shared.bus import EmbeddedRedis
from tests.test_gateway import anyio_backend, model_name, start, tokenizer

__all__ = ["anyio_backend", "tokenizer"]  # fixtures shared with the gateway tests

pytestmark = pytest.mark.anyio

FUZZ_SCALE = int(os.environ.get("AUGURY_FUZZ_SCALE", "1"))
NUM_BODIES = 300 * FUZZ_SCALE
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stream", "stream_options", "stop", "stop_token_ids", "ignore_eos", "n",
    "priority", "augury", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "tools", "tool_choice", "response_format", "user", "echo", "best_of",
    "suffix", "unknown_field",
)  # fmt: skip
SCALARS: tuple[Any, ...] = (
    None, True, False, 0, 1, -1, 2**31, -(2**63), 10**40, 0.5, -0.5, 1e-320, 1e308,
    float("nan"), float("inf"), float("-inf"), "", "x", "ü" * 3, "a" * 5000, "fail",
)  # fmt: skip


def value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.random()
    if depth > 3 or kind < 0.55:
        return rng.choice(SCALARS)
    if kind < 0.8:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["role", "content", "type", "text", "include_usage", "continuous_usage_stats",
            "tpot_slo_ms", "draft_model", "speculate", "x"]  # fmt: skip
    return {rng.choice(keys): value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def plausible_messages(rng: random.Random) -> Any:
    roles = ["user", "assistant", "system", "robot", 7, None]
    return [
        {"role": rng.choice(roles), "content": value(rng, 2) if rng.random() < 0.5 else "hi"}
        for _ in range(rng.randint(0, 3))
    ]


def body(rng: random.Random, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model_name() if rng.random() < 0.9 else value(rng)}
    if chat:
        out["messages"] = plausible_messages(rng) if rng.random() < 0.7 else value(rng)
    else:
        out["prompt"] = rng.choice(["Say hi", value(rng), [1, 2, 3], [-1], [10**12]])
    out["max_tokens"] = rng.choice([4, 8, value(rng)])
    for name in rng.sample(FIELDS, rng.randint(0, 6)):
        out[name] = value(rng)
    return out


async def assert_still_serves(client: TestClient) -> None:
    good = {"model": model_name(), "prompt": "Say hi", "max_tokens": 4}
    response = await client.post("/v1/completions", json=good)
    assert response.status == 200, await response.text()
    assert (await response.json())["choices"][0]["text"]


async def test_no_input_makes_a_5xx(server: EmbeddedRedis, tokenizer: Any) -> None:
    client, scheduler, consumer = await start(server, tokenizer, "fuzz", output_idle_timeout_s=2.0)
    rng = random.Random(20261122)
    statuses: dict[int, int] = {}
    try:
        for i in range(NUM_BODIES):
            chat = i % 2 == 0
            path = "/v1/chat/completions" if chat else "/v1/completions"
            payload = json.dumps(body(rng, chat))  # NaN and Infinity go out as JSON extensions
            response = await client.post(
                path, data=payload, headers={"Content-Type": "application/json"}
            )
            text = await response.text()
            statuses[response.status] = statuses.get(response.status, 0) + 1
            assert response.status < 500, (response.status, payload, text)
            if response.status >= 400 and response.content_type == "application/json":
                error = json.loads(text)["error"]
                assert set(error) == {"message", "type", "param", "code"}, text
        for raw in (b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"model": 1e999999}', b"1" * 10000):
            response = await client.post("/v1/completions", data=raw)
            assert 400 <= response.status < 500, raw
        await assert_still_serves(client)
        print(
            f"\nHTTP fuzz: {NUM_BODIES} bodies + 7 raw, statuses {dict(sorted(statuses.items()))}"
        )
        assert statuses.get(200, 0) > 10  # the grammar also makes good requests
        assert sum(n for s, n in statuses.items() if 400 <= s < 500) > NUM_BODIES // 2
    finally:
        await consumer.stop()
        await client.close()
        await scheduler.bus.close()


def test_the_grammar_reaches_the_edge_values() -> None:
    rng = random.Random(1)
    seen = {json.dumps(body(rng, i % 2 == 0)) for i in range(NUM_BODIES)}
    text = " ".join(seen)
    for needle in ("NaN", "Infinity", "1e-320", '"fail"', "unknown_field", "logit_bias"):
        assert needle in text, needle
