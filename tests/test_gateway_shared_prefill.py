"""n > 1 shares one prefill: the gateway submits choice 0 first and the other choices once its
prefill has committed, so that they find the prompt's full KV blocks in the prefix cache; with
prefix caching off every choice goes at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from services.gateway.app import Gateway
from services.run import start_stack
from services.runtime import ModelPaths
from shared.bus import Bus, EmbeddedRedis, StreamConsumer
from shared.wire.streams import SCHEDULER, requests_stream
from tests.test_gateway import StandInScheduler, tokenizer  # noqa: F401
from tests.test_gateway import make_settings as gateway_settings
from tests.test_gateway_options import post
from tests.test_services_openai import free_port, wait_for_gateway
from tests.test_services_support import make_settings

pytestmark = pytest.mark.anyio
PROMPT = (
    "A long prompt whose blocks the choices share: the three largest cities of France are "
    "Paris, Marseille and Lyon, and the three largest cities of Italy are Rome, Milan and"
)
BLOCK = 16


@pytest.mark.smollm2
async def test_three_choices_share_choice_zeros_prefill(server: EmbeddedRedis) -> None:
    from shared.model.smollm2 import ensure_smollm2

    target = ensure_smollm2()
    prompt_len = len(AutoTokenizer.from_pretrained(target).encode(PROMPT))
    assert prompt_len > 2 * BLOCK
    port = free_port()
    settings = make_settings(
        server.url,
        "sharedprefill",
        engine={"block_size": BLOCK, "kv_memory_bytes": 64 << 20},
        gateway={"port": port},
        models={"target_dir": target},
    )
    stack = await start_stack(settings, server.url, ModelPaths(target, {"self": target}))
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    body: dict[str, Any] = {
        "model": settings.gateway.model_name,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
    }
    try:
        await wait_for_gateway(client)
        assert stack.verifier is not None
        prefix = stack.verifier.runner.cache.prefix
        assert prefix is not None
        hits = prefix.hits
        answer = await client.completions.create(**body, n=3)
        # choices 1 and 2 found the full blocks of choice 0's prompt (the last prompt token is
        # always computed, so the blocks of prompt_len - 1 tokens)
        shared = (prompt_len - 1) // BLOCK * BLOCK
        assert prefix.hits - hits == 2 * shared
        assert answer.usage.prompt_tokens == prompt_len
        single = await client.completions.create(**body)
        assert [c.text for c in answer.choices] == [single.choices[0].text] * 3
        assert [c.index for c in answer.choices] == [0, 1, 2]
    finally:
        await client.close()
        await stack.stop()


async def test_without_prefix_caching_every_choice_goes_at_once(
    server: EmbeddedRedis,
    tokenizer: Any,  # noqa: F811
) -> None:
    name = "no-prefix-n"
    settings = gateway_settings()
    settings = settings.model_copy(
        update={
            "service": settings.service.model_copy(update={"cell": f"t-{name}"}),
            "engine": settings.engine.model_copy(update={"enable_prefix_caching": False}),
        }
    )
    scheduler = StandInScheduler(Bus(server.url, settings.redis, f"{name}-sched"), tokenizer)
    consumer = StreamConsumer(
        scheduler.bus,
        group=SCHEDULER,
        streams=[requests_stream(f"t-{name}")],
        handler=scheduler,
        concurrency=8,
    )
    bus = Bus(server.url, settings.redis, name)
    gateway = Gateway(settings, bus, tokenizer, vocab_size=len(tokenizer), max_context=2048)
    client = TestClient(TestServer(gateway.app()))
    await client.start_server()
    await consumer.start()
    try:
        body = {"messages": [{"role": "user", "content": "hang"}], "n": 3, "stream": True}
        response = await post(client, "/v1/chat/completions", body)
        await response.content.readline()
        for _ in range(100):  # choice 0 never gets a token, yet all three are in the scheduler
            if len(scheduler.submits) == 3:
                break
            await asyncio.sleep(0.05)
        assert sorted(s.request_id[-2:] for s in scheduler.submits) == ["-0", "-1", "-2"]
        response.close()
    finally:
        await consumer.stop()
        await client.close()
        await scheduler.bus.close()
