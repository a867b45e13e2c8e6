"""Cancels, malformed entries, redeliveries and replicas, on the real services over real Redis."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.tree import TokenTree
from shared.wire import (
    DraftJob,
    DraftRequest,
    FinishReason,
    Submit,
    Tokens,
    VerifyJob,
    VerifyRequest,
)
from shared.wire.streams import (
    candidates_stream,
    dead_letter_stream,
    draft_stream,
    output_stream,
    requests_stream,
    results_stream,
    verify_stream,
)
from tests.test_services_support import Client, make_settings, plain_greedy, running, until

pytestmark = pytest.mark.anyio


PROMPT = [5, 17, 33, 2, 80, 41]


async def test_cancel_mid_stream_frees_kv_in_verifier_and_drafter(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    models = ModelPaths(tiny_target_dir, {"d": tiny_draft_dir})
    async with running(server.url, "cancel", models) as (stack, client):
        assert stack.verifier is not None and stack.scheduler is not None
        [drafter] = stack.drafters
        await client.submit("doomed", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        while len(client.outcomes["doomed"].tokens) < 10:
            await client.poll()
        assert stack.verifier.runner.has_request("doomed")
        assert drafter.runner.has_request("doomed")
        await client.cancel("doomed")
        await until(lambda: "doomed" not in stack.scheduler.requests, what="the cancel")
        await until(lambda: not stack.verifier.runner.has_request("doomed"), what="target KV")
        await until(lambda: not drafter.runner.has_request("doomed"), what="draft KV")
        assert (
            stack.verifier.runner.cache.allocator.num_free == stack.verifier.runner.cache.num_blocks
        )
        assert drafter.runner.cache.allocator.num_free == drafter.runner.cache.num_blocks
        assert client.outcomes["doomed"].finish is None  # cut short, no more than 400 tokens
        # the services go on serving
        [want] = plain_greedy(tiny_target_dir, [PROMPT], [SamplingParams(max_tokens=12)])
        await client.submit("after", PROMPT, SamplingParams(max_tokens=12))
        await client.wait(["after"])
        assert client.outcomes["after"].tokens == want


async def test_malformed_entries_are_dead_lettered_and_services_keep_running(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    cell = "faults"
    models = ModelPaths(tiny_target_dir, {"d": tiny_draft_dir})
    async with running(server.url, cell, models) as (stack, client):
        [drafter] = stack.drafters
        redis = client.bus.redis
        streams = [
            requests_stream(cell),
            draft_stream(cell, "d", drafter.replica),
            candidates_stream(cell),
            verify_stream(cell),
            results_stream(cell),
        ]
        wrong_type = Tokens("x", 0, 0, (1,)).to_entry()  # well-formed, but not for these streams
        whole = Submit("cut", tuple(PROMPT), SamplingParams(max_tokens=4), "s", 0.0).to_entry()
        truncated = {**whole, "b": whole["b"][: len(whole["b"]) // 2]}
        no_version = {**whole, "v": b"0"}
        for stream in streams:
            await redis.xadd(stream, {"v": b"1", "t": b"submit", "b": b"\xc1 not msgpack"})
            await redis.xadd(stream, {"garbage": b"yes"})
            await redis.xadd(stream, wrong_type)
            await redis.xadd(stream, truncated)
            await redis.xadd(stream, no_version)
        for stream in streams:
            dead = dead_letter_stream(stream)
            await until_async_len(redis, dead, 5)
            reasons = [f[b"dead_reason"].decode() for _, f in await redis.xrange(dead)]
            assert any("malformed" in r for r in reasons), reasons
            assert any("rejected by handler" in r for r in reasons), reasons
        [want] = plain_greedy(tiny_target_dir, [PROMPT], [SamplingParams(max_tokens=15)])
        await client.submit("alive", PROMPT, SamplingParams(max_tokens=15))
        await client.wait(["alive"])
        assert client.outcomes["alive"].tokens == want
        for consumer in [*stack.scheduler.consumers, drafter.consumer, stack.verifier.consumer]:
            assert consumer.crashed is None


async def test_a_submit_naming_a_foreign_stream_is_dropped(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    # whoever can write the requests stream must not make the scheduler write anywhere else
    models = ModelPaths(tiny_target_dir, {"d": tiny_draft_dir})
    async with running(server.url, "foreign", models) as (stack, client):
        redis = client.bus.redis
        victim = "somebody:else:stream"
        bad = Submit("intruder", tuple(PROMPT), SamplingParams(max_tokens=4), victim, 0.0)
        await client.bus.publish(requests_stream("foreign"), bad)
        [want] = plain_greedy(tiny_target_dir, [PROMPT], [SamplingParams(max_tokens=6)])
        await client.submit("fine", PROMPT, SamplingParams(max_tokens=6))
        await client.wait(["fine"])  # submitted after the intruder: that one was handled
        assert client.outcomes["fine"].tokens == want
        assert await redis.exists(victim) == 0
        assert "intruder" not in stack.scheduler.core.requests
        # a gateway's stream name, but no such gateway is alive: nobody could read the answer
        ghost = output_stream("foreign", "ghost")
        await client.bus.publish(
            requests_stream("foreign"),
            Submit("haunted", tuple(PROMPT), SamplingParams(max_tokens=4), ghost, 0.0),
        )
        await client.submit("fine-too", PROMPT, SamplingParams(max_tokens=6))
        await client.wait(["fine-too"])
        assert await redis.exists(ghost) == 0
        assert "haunted" not in stack.scheduler.core.requests


async def test_requests_whose_gateway_stopped_beating_are_cancelled(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    models = ModelPaths(tiny_target_dir, {"d": tiny_draft_dir})
    async with running(server.url, "orphans", models) as (stack, client):
        assert stack.scheduler is not None and stack.verifier is not None
        doomed = Client(server.url, make_settings(server.url, "orphans"), "doomed-gateway")
        try:
            await doomed.submit("orphan", PROMPT, SamplingParams(max_tokens=400))
            await until(lambda: "orphan" in stack.scheduler.core.requests, what="admitted")
            await doomed.heartbeat.stop()  # the gateway dies: its heartbeat goes
            await until(lambda: "orphan" not in stack.scheduler.core.requests, what="cancelled")
            await until(lambda: not stack.verifier.runner.has_request("orphan"), what="freed")
            # ... and is told why, should it have only stalled
            await doomed.wait(["orphan"], timeout_s=10)
            error = doomed.outcomes["orphan"].error
            assert error is not None and error.code == "gateway_lost", doomed.outcomes["orphan"]
        finally:
            await doomed.close()
        # the live gateway's requests are untouched
        [want] = plain_greedy(tiny_target_dir, [PROMPT], [SamplingParams(max_tokens=6)])
        await client.submit("kept", PROMPT, SamplingParams(max_tokens=6))
        await client.wait(["kept"])
        assert client.outcomes["kept"].tokens == want


async def test_a_gateway_whose_heartbeat_lapses_briefly_keeps_its_requests(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    """A gateway stalled past one heartbeat TTL (its event loop starved on a loaded machine)
    beats again before a second TTL: its request is not cancelled and answers in full."""
    models = ModelPaths(tiny_target_dir, {"d": tiny_draft_dir})
    async with running(server.url, "lapse", models) as (stack, client):
        assert stack.scheduler is not None and stack.verifier is not None
        scheduler = stack.scheduler
        ttl_s = client.bus.settings.heartbeat_ttl_ms / 1000
        params = SamplingParams(max_tokens=40)
        hold = threading.Event()  # the verifier's model thread waits: the request stays running
        held = asyncio.ensure_future(stack.verifier.model_thread.run(hold.wait, 30.0))
        try:
            await client.submit("stalled", PROMPT, params)
            await until(lambda: "stalled" in scheduler.core.requests, what="admitted")
            await client.heartbeat.stop()  # its key is gone at once (an expiry takes one TTL)
            await until(lambda: client.reply_to not in scheduler.gateways.live, what="a lapse")
            await asyncio.sleep(ttl_s / 3)
            await client.heartbeat.start()
            await until(lambda: client.reply_to in scheduler.gateways.live, what="beats again")
            assert not scheduler.core.requests["stalled"].cancelled
        finally:
            hold.set()
            await held
        await client.wait(["stalled"])
        [want] = plain_greedy(tiny_target_dir, [PROMPT], [params])
        assert client.outcomes["stalled"].error is None
        assert client.outcomes["stalled"].tokens == want


async def until_async_len(redis: object, stream: str, n: int, timeout_s: float = 10.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while await redis.xlen(stream) < n:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"{stream} has fewer than {n} dead letters"
        await asyncio.sleep(0.05)


async def test_redelivered_jobs_are_answered_again_without_recomputing(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    """Handlers are idempotent per (request, step): a repeated job replays the same answer."""
    models = ModelPaths(tiny_target_dir, {"d": tiny_draft_dir})
    async with running(server.url, "replay", models) as (stack, _):
        assert stack.verifier is not None
        [drafter] = stack.drafters
        greedy = SamplingParams(max_tokens=8)
        prefill = VerifyJob(
            7, (VerifyRequest("q", 0, greedy, 1, 8, chunk=tuple(PROMPT), chunk_is_last=True),)
        )
        first = stack.verifier.verify_job(prefill)
        again = stack.verifier.verify_job(prefill)
        assert first is not None and again is not None
        assert again.entries[0] == first.entries[0] and stack.verifier.stats.replayed == 1
        token = first.entries[0].bonus
        assert token is not None
        job = DraftJob(
            8, (DraftRequest("q", 1, 0, (*PROMPT, token), DraftMethod("chain", k=3), greedy, 1),)
        )
        trees = drafter.draft_job(job)
        replay = drafter.draft_job(job)
        assert trees is not None and replay is not None and drafter.stats.replayed == 1
        assert trees.entries[0].tree is replay.entries[0].tree
        # a tree for a request the verifier holds nothing for: out of sync, nothing committed
        lost = VerifyJob(9, (VerifyRequest("lost", 3, greedy, 1, 8, tree=TokenTree.root_only(4)),))
        answer = stack.verifier.verify_job(lost)
        assert answer is not None and (answer.entries[0].error or "").startswith("out_of_sync")
        # a stale tree (its root is not where the KV ends) is refused, the KV stays as it was
        held = stack.verifier.runner.num_cached("q")
        for root_at, refused in ((held + 1, True), (held - 1, True), (held, False)):
            tree = TokenTree.root_only(token)
            entry = VerifyRequest("q", 2, greedy, 1, 8, tree=tree, context_len=root_at)
            answer = stack.verifier.verify_job(VerifyJob(10 + root_at, (entry,)))
            assert answer is not None
            error = answer.entries[0].error or ""
            assert error.startswith("out_of_sync") == refused, error
        assert stack.verifier.runner.num_cached("q") == held + 1  # only the in-sync tree ran


async def test_two_drafter_replicas_share_the_load(
    server: EmbeddedRedis, tiny_target_dir: Path
) -> None:
    models = ModelPaths(tiny_target_dir, {"d": tiny_target_dir})
    prompts = [[3 + i, 9, 27 + i, 4] for i in range(8)]
    params = [SamplingParams(max_tokens=12 + i) for i in range(8)]
    expected = plain_greedy(tiny_target_dir, prompts, params)
    async with running(server.url, "replicas", models, drafter_replicas=2) as (stack, client):
        assert stack.scheduler is not None
        assert len(stack.drafters) == 2
        assert sorted(stack.scheduler.drafters.replicas["d"]) == sorted(
            d.replica for d in stack.drafters
        )
        for i, prompt in enumerate(prompts):
            await client.submit(f"w{i}", prompt, params[i])
        # each Submit is stored before the next is read: wait until all eight are matched
        await until(lambda: sum(stack.scheduler.drafters.load().values()) == 8, what="all matched")
        assert sorted(stack.scheduler.drafters.load().values()) == [4, 4]
        await client.wait([f"w{i}" for i in range(8)])
        for drafter in stack.drafters:
            assert drafter.stats.requests > 0
            assert drafter.stats.errors == {}  # sticky: no replica ever saw a request out of sync
        ratio = stack.drafters[0].stats.requests / stack.drafters[1].stats.requests
        assert 0.5 < ratio < 2.0
    for i, want in enumerate(expected):
        assert client.outcomes[f"w{i}"].tokens == want
        assert client.outcomes[f"w{i}"].finish is FinishReason.LENGTH
