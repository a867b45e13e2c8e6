"""Greedy decoding through the services equals plain greedy decoding of the target, token for
token: every drafting method, several micro-batch settings, many requests at once, preemption.

Real Redis (embedded), real (tiny, random) LLaMA models on CPU; every message goes through Redis.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.bus.preemptions import read_preemptions
from shared.values.sampling import SamplingParams
from shared.wire import FinishReason
from tests.test_services_support import Client, Outcome, plain_greedy, running

pytestmark = pytest.mark.anyio


def prompts_of(n: int) -> list[list[int]]:
    """n prompts of different lengths (1 to 23 tokens) over the tiny vocabulary."""
    return [[(7 * i + 3 * j + 1) % 95 + 1 for j in range(1 + (5 * i) % 23)] for i in range(n)]


async def serve_all(
    client: Client, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Outcome]:
    """Submit every prompt at once (ids r0, r1, ...); each request's outcome, in order."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        await client.submit(rid, prompt, p)
    await client.wait(ids)
    return [client.outcomes[rid] for rid in ids]


CASES = [
    pytest.param("chain", 1, "tiny", id="chain-M1-tiny-draft"),
    pytest.param("chain", 2, "self", id="chain-M2-self-draft"),
    pytest.param("static", 2, "self", id="static-M2-self-draft"),
    pytest.param("beam", 1, "tiny", id="beam-M1-tiny-draft"),
    pytest.param("dynamic", 3, "self", id="dynamic-M3-self-draft"),
    pytest.param("none", 2, "tiny", id="no-speculation-M2"),
]


@pytest.mark.parametrize(("method", "micro_batches", "draft"), CASES)
async def test_greedy_equals_plain_decoding(
    server: EmbeddedRedis,
    tiny_target_dir: Path,
    tiny_draft_dir: Path,
    method: str,
    micro_batches: int,
    draft: str,
) -> None:
    # "self": the target drafts for itself, so every draft token is accepted and the
    # multi-token commit path runs; "tiny": a different random model, so almost none are.
    draft_dir = tiny_target_dir if draft == "self" else tiny_draft_dir
    models = ModelPaths(tiny_target_dir, {"d": draft_dir})
    prompts = prompts_of(6)
    params = [SamplingParams(max_tokens=9 + 4 * i) for i in range(len(prompts))]
    expected = plain_greedy(tiny_target_dir, prompts, params)
    scheduler = {"micro_batches": micro_batches, "speculation": {"method": method}}
    async with running(server.url, f"g-{method}-{micro_batches}", models, scheduler=scheduler) as (
        stack,
        client,
    ):
        outcomes = await serve_all(client, prompts, params)
        for i, (outcome, want) in enumerate(zip(outcomes, expected, strict=True)):
            assert outcome.tokens == want, f"request {i}"
            assert outcome.finish is FinishReason.LENGTH
        stats = stack.scheduler.stats if stack.scheduler else None
        assert stats is not None and stats.iterations > 0
        if method != "none":
            assert stats.acceptance.num_draft_tokens > 0
            if draft == "self":  # the best path is always accepted whole
                if method == "chain":
                    assert stats.acceptance.acceptance_rate == 1.0
                total = sum(len(w) for w in expected)
                assert stats.acceptance.num_target_forwards < total / 2


async def test_sixteen_concurrent_streams(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    """16 streaming requests of different lengths at once: all finish, each stream in order."""
    models = ModelPaths(tiny_target_dir, {"d": tiny_target_dir, "tiny": tiny_draft_dir})
    prompts = prompts_of(16)
    params = [SamplingParams(max_tokens=5 + (11 * i) % 37) for i in range(16)]
    expected = plain_greedy(tiny_target_dir, prompts, params)
    scheduler = {"micro_batches": 2, "speculation": {"method": "chain", "chain_length": 3}}
    async with running(server.url, "sixteen", models, scheduler=scheduler) as (_, client):
        for i in range(16):
            await client.submit(f"s{i}", prompts[i], params[i])
        await client.wait([f"s{i}" for i in range(16)])
    for i in range(16):
        outcome = client.outcomes[f"s{i}"]
        assert outcome.tokens == expected[i], f"request {i}"
        assert outcome.chunks >= 2  # streamed: the first token, then the rest over several steps


async def test_preemption_by_recompute_keeps_greedy_output(
    server: EmbeddedRedis, tiny_target_dir: Path
) -> None:
    """A KV cache too small for all requests at once: the verifier refuses, the scheduler
    recomputes later, and the output is still plain greedy decoding."""
    models = ModelPaths(tiny_target_dir, {"d": tiny_target_dir})
    prompts = prompts_of(10)
    params = [SamplingParams(max_tokens=30) for _ in prompts]
    expected = plain_greedy(tiny_target_dir, prompts, params)
    groups = {
        "engine": {"kv_memory_bytes": 96 << 10},  # ~190 tokens of the tiny target
        "scheduler": {"micro_batches": 2},
    }
    async with running(server.url, "preempt", models, **groups) as (stack, client):
        for i, prompt in enumerate(prompts):
            await client.submit(f"p{i}", prompt, params[i])
        await client.wait([f"p{i}" for i in range(len(prompts))])
        scheduler = stack.scheduler
        assert scheduler is not None and scheduler.core.preemptions["recomputed"] > 0
        totals = await read_preemptions(scheduler.bus, scheduler.cell)  # what /metrics exports
        assert 0 < totals["recomputed"] <= scheduler.core.preemptions["recomputed"]
    for i, want in enumerate(expected):
        assert client.outcomes[f"p{i}"].tokens == want, f"request {i}"


async def test_las_preempts_keeping_kv_and_greedy_output_is_unchanged(
    server: EmbeddedRedis, tiny_target_dir: Path
) -> None:
    """Two running slots for six requests under LAS: the scheduler preempts all along, the
    verifier and the drafter keep the preempted requests' state, and nothing is recomputed."""
    models = ModelPaths(tiny_target_dir, {"d": tiny_target_dir})
    prompts = prompts_of(6)
    params = [SamplingParams(max_tokens=12 + 4 * i) for i in range(len(prompts))]
    expected = plain_greedy(tiny_target_dir, prompts, params)
    groups = {"scheduler": {"policy": "las", "max_running_requests": 2}}
    async with running(server.url, "las", models, **groups) as (stack, client):
        for i, prompt in enumerate(prompts):
            await client.submit(f"l{i}", prompt, params[i])
        await client.wait([f"l{i}" for i in range(len(prompts))])
        scheduler = stack.scheduler
        assert scheduler is not None and scheduler.core.preemptions["kept"] > 0
        assert scheduler.core.preemptions["recomputed"] == 0
        assert scheduler.stats.acceptance.num_accepted > 0  # speculation ran and was accepted
    for i, want in enumerate(expected):
        assert client.outcomes[f"l{i}"].tokens == want, f"request {i}"


async def test_stop_tokens_and_errors(server: EmbeddedRedis, tiny_target_dir: Path) -> None:
    models = ModelPaths(tiny_target_dir, {"d": tiny_target_dir})
    [prompt] = prompts_of(1)
    [free_run] = plain_greedy(tiny_target_dir, [prompt], [SamplingParams(max_tokens=20)])
    stop = free_run[5]
    cut = free_run[: free_run.index(stop)]
    async with running(server.url, "stops", models) as (_, client):
        await client.submit("stop", prompt, SamplingParams(max_tokens=20, stop_token_ids=(stop,)))
        await client.submit("vocab", [1, 500], SamplingParams(max_tokens=4))
        await client.submit("long", prompt, SamplingParams(max_tokens=600))
        await client.wait(["stop", "vocab", "long"])
    assert client.outcomes["stop"].tokens == cut
    assert client.outcomes["stop"].finish is FinishReason.STOP
    vocab_error = client.outcomes["vocab"].error
    assert vocab_error is not None and vocab_error.param == "prompt"
    long_error = client.outcomes["long"].error
    assert long_error is not None and long_error.code == "context_length_exceeded"


@pytest.mark.parametrize("merge", ["off", "standby"])
async def test_fast_switching_through_the_services_keeps_greedy_output(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path, merge: str
) -> None:
    # two draft models and LBSS switching requests between them every slot of its exploration;
    # the standby drafter is warmed in the same round as the step's drafts ("off"), or drafts
    # a tree of its own that is merged with the current drafter's ("standby")
    models = ModelPaths(tiny_target_dir, {"self": tiny_target_dir, "tiny": tiny_draft_dir})
    prompts = prompts_of(6)
    params = [SamplingParams(max_tokens=24 + 2 * i) for i in range(len(prompts))]
    expected = plain_greedy(tiny_target_dir, prompts, params)
    scheduler = {
        "draft_chooser": "lbss",
        "lbss": {"alpha": 4, "beta": 1},
        "fast_switching": True,
        "merge_drafts": merge,
        "speculation": {"method": "chain", "planner": "fixed"},
    }
    async with running(server.url, f"g-fast-{merge}", models, scheduler=scheduler) as (
        stack,
        client,
    ):
        outcomes = await serve_all(client, prompts, params)
        assert [o.tokens for o in outcomes] == expected
        assert stack.scheduler is not None
        core = stack.scheduler.core
        assert core.switches["warm"] > 0  # switched onto a standby the services kept in step
        assert stack.scheduler.stats.acceptance.num_accepted > 0
        # a warm switch sends only the newest tokens; had the scheduler miscounted what the
        # standby holds, that drafter would have answered out_of_sync
        assert core.switches["warm_tokens"] <= 5 * core.switches["warm"]
        assert (core.num_merged_trees > 0) == (merge == "standby")
        assert not any(d.stats.errors for d in stack.drafters), [
            dict(d.stats.errors) for d in stack.drafters
        ]
