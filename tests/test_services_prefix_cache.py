"""Prefix caching behind the real services, over real Redis: a conversation's later turns find
their history cached (reported as cached tokens), and a verifier restart or a drafter that loses
its requests' state mid-conversation loses no token."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI

from services.run import start_stack, start_verifier
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.values.sampling import SamplingParams
from shared.wire import Tokens
from tests.test_feature_draft import feature_draft_dir  # noqa: F401  (a fixture)
from tests.test_services_openai import (  # noqa: F401  (smollm2_models: a fixture)
    QUESTION,
    free_port,
    smollm2_models,
    wait_for_gateway,
)
from tests.test_services_support import Client, make_settings, plain_greedy, running

pytestmark = pytest.mark.anyio

SYSTEM = [7, 3, 19, 40, 41, 8, 8, 2, 30, 31, 32, 5, 6, 70, 71, 12, 13, 9]  # 4 blocks of 4, +2
CHAIN = {"speculation": {"method": "chain", "chain_length": 3}}


async def tokens_at_least(client: Client, request_id: str, n: int, timeout_s: float = 60) -> None:
    """Read the output stream until the request has `n` tokens (and has not finished)."""
    deadline = time.monotonic() + timeout_s
    while len(client.outcomes[request_id].tokens) < n:
        assert time.monotonic() < deadline, f"timed out waiting for {request_id}"
        await client.poll(block_ms=50)
    assert not client.outcomes[request_id].done, "it finished before the fault"


async def turn(
    client: Client, request_id: str, prompt: list[int], params: SamplingParams
) -> tuple[list[int], int | None]:
    """One request to the end: its tokens and the cached prompt tokens it was told of."""
    await client.submit(request_id, prompt, params)
    cached: list[int | None] = []
    while not client.outcomes[request_id].done:
        for message in await client.poll():
            mine = isinstance(message, Tokens) and message.request_id == request_id
            if mine and message.finish is not None:
                cached.append(message.cached_tokens)
    outcome = client.outcomes[request_id]
    assert outcome.error is None, outcome.error
    return outcome.tokens, cached[-1] if cached else None


async def test_a_conversation_reuses_its_history_through_restarts(
    server: EmbeddedRedis, tiny_target_dir: Path
) -> None:
    models = ModelPaths(tiny_target_dir, {"d": tiny_target_dir})  # a self-draft accepts all
    params = SamplingParams(max_tokens=8)
    async with running(server.url, "prefix", models, scheduler=CHAIN) as (stack, client):
        verifier, [drafter] = stack.verifier, stack.drafters
        assert verifier is not None

        first, cached = await turn(client, "t1", SYSTEM, params)
        assert first == plain_greedy(tiny_target_dir, [SYSTEM], [params])[0]
        assert cached == 0  # nothing to find yet

        history = SYSTEM + first + [44, 45]
        second, cached = await turn(client, "t2", history, params)
        assert second == plain_greedy(tiny_target_dir, [history], [params])[0]
        assert cached == ((len(SYSTEM) + len(first) - 1) // 4) * 4  # every full block computed
        assert verifier.runner.cache.prefix.hits == cached
        assert drafter.runner.cache.prefix.hits > 0  # the draft drafted over it once too
        assert client.outcomes["t2"].accepted_tokens > 0

        # the verifier restarts (a new process: an empty cache) while turn 3 is generating
        history = history + second + [46]
        long_params = SamplingParams(max_tokens=30)
        await client.submit("t3", history, long_params)
        await tokens_at_least(client, "t3", 4)
        await verifier.stop()
        for keeper in stack.lease_keepers:  # a clean stop gives the cell's verifier lease up
            keeper.cancel()
        stack.lease_keepers.clear()
        assert stack.verifier_lease is not None
        await stack.verifier_lease.release()
        fresh = await start_verifier(stack, models, "prefix-verifier-2")
        assert fresh.runner.cache.prefix is not None and len(fresh.runner.cache.prefix) == 0
        await client.wait(["t3"], timeout_s=120)
        third = client.outcomes["t3"].tokens
        assert third == plain_greedy(tiny_target_dir, [history], [long_params])[0]

        # the drafter loses every request's state mid-turn (its cache of blocks stays)
        history = history + third + [47]
        await client.submit("t4", history, long_params)
        await tokens_at_least(client, "t4", 4)

        def lose_state() -> None:
            drafter.forget("t4")

        await drafter._thread.run(lose_state)
        await client.wait(["t4"], timeout_s=120)
        assert (
            client.outcomes["t4"].tokens
            == plain_greedy(tiny_target_dir, [history], [long_params])[0]
        )
        assert fresh.runner.cache.prefix.hits > 0  # the restarted verifier's cache fills again


@pytest.mark.smollm2
async def test_cached_tokens_reach_the_http_usage_and_metrics(
    server: EmbeddedRedis,
    smollm2_models: ModelPaths,  # noqa: F811
) -> None:
    """The whole stack on SmolLM2 behind the OpenAI client: a chat's second turn reports the
    history it found cached in `usage.prompt_tokens_details.cached_tokens`, and /metrics
    counts the hits."""
    port = free_port()
    settings = make_settings(
        server.url,
        "prefix-http",
        engine={"block_size": 16, "kv_memory_bytes": 64 << 20},
        gateway={"port": port},
        models={"target_dir": smollm2_models.target},
    )
    stack = await start_stack(settings, server.url, smollm2_models)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        await wait_for_gateway(client)
        messages = [{"role": "user", "content": QUESTION}]
        first = await client.chat.completions.create(
            model=settings.gateway.model_name,
            messages=messages,
            max_completion_tokens=8,
            temperature=0,
        )
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And of Italy?"},
        ]
        stream = await client.chat.completions.create(
            model=settings.gateway.model_name,
            messages=messages,
            max_completion_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens
        # the first turn's prompt, in full blocks of 16 (its answer's tokens are re-tokenized
        # by the chat template, so they need not match)
        assert first.usage.prompt_tokens // 16 * 16 <= cached < usage.prompt_tokens
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            metrics = await response.text()
        queried = first.usage.prompt_tokens + usage.prompt_tokens
        assert f"augury_prefix_cache_queries_total {float(queried)}" in metrics
        assert f"augury_prefix_cache_hits_total {float(cached)}" in metrics
    finally:
        await client.close()
        await stack.stop()


def test_a_resumed_request_keeps_its_cached_token_count() -> None:
    """A successor scheduler reads the count back with the request's progress (its usage)."""
    from services.scheduler.store import Progress, decode_progress, encode_progress

    progress = Progress([], 3, cached_prompt_tokens=24)
    back = decode_progress(encode_progress(progress), b"", b"")
    assert back.cached_prompt_tokens == 24


async def test_requests_arriving_together_share_their_prefix_through_the_services(
    server: EmbeddedRedis, tiny_target_dir: Path
) -> None:
    """Two requests with a 40-token shared prefix submitted at once: the scheduler service's
    core holds the second back while the first's chunk computes the prefix, then charges it only
    the rest; the verifier computes the prefix once."""
    models = ModelPaths(tiny_target_dir, {"d": tiny_target_dir})
    params = SamplingParams(max_tokens=4)
    shared = [(7 * i + 3) % 90 + 5 for i in range(40)]
    prompts = [shared + [50, 51, 52], shared + [60, 61]]
    async with running(server.url, "prefix-together", models, scheduler=CHAIN) as (stack, client):
        verifier = stack.verifier
        assert verifier is not None
        before = verifier.runner.cache.prefix.hits
        for i, prompt in enumerate(prompts):
            await client.submit(f"s{i}", prompt, params)
        await client.wait(["s0", "s1"], timeout_s=120)
        outputs = [client.outcomes[f"s{i}"].tokens for i in range(2)]
        assert outputs == plain_greedy(tiny_target_dir, prompts, [params] * 2)
        assert verifier.runner.cache.prefix.hits - before == 40  # the second found all of it


async def test_a_feature_draft_conversation_finds_the_target_blocks(
    server: EmbeddedRedis,
    tiny_target_dir: Path,
    feature_draft_dir: Path,  # noqa: F811
) -> None:
    """With a feature-level draft configured every speculating request wants the target's
    features; the verifier keeps them with its blocks, so the second turn finds its history
    cached in the target too, and its output is still plain decoding's."""
    models = ModelPaths(tiny_target_dir, {"e": feature_draft_dir})
    params = SamplingParams(max_tokens=8)
    async with running(server.url, "prefix-feat", models, scheduler=CHAIN) as (stack, client):
        verifier = stack.verifier
        assert verifier is not None and stack.scheduler is not None
        assert stack.scheduler.core.config.feature_drafts == frozenset({"e"})
        first, cached = await turn(client, "t1", SYSTEM, params)
        assert first == plain_greedy(tiny_target_dir, [SYSTEM], [params])[0]
        history = SYSTEM + first + [44, 45]
        second, cached = await turn(client, "t2", history, params)
        assert second == plain_greedy(tiny_target_dir, [history], [params])[0]
        assert cached == ((len(SYSTEM) + len(first) - 1) // 4) * 4
        assert verifier.runner.cache.prefix.hits == cached
        assert client.outcomes["t2"].draft_tokens > 0
