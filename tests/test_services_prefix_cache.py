"""Prefix caching behind the real services, over real Redis: a conversation's later turns find
their history cached (reported as cached tokens), and a verifier restart or a drafter that loses
its requests' state mid-conversation loses no token."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.run import start_verifier
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.engine.sampling import SamplingParams
from shared.wire import Tokens
from tests.test_services_support import Client, plain_greedy, running

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
        assert client.outcomes["t4"].tokens == plain_greedy(
            tiny_target_dir, [history], [long_params]
        )[0]
        assert fresh.runner.cache.prefix.hits > 0  # the restarted verifier's cache fills again
