"""Unit tests of the scheduler service's own pieces: reply settling and the settings that build
its core (drafting method, policies, limits). No Redis, no models. The scheduling decisions
themselves are the core's (tests/test_scheduler_core.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.replies import Replies
from shared.engine.presets import DEFAULT_METHOD
from shared.scheduling.factory import TargetInfo, build_core, method_from_settings
from shared.scheduling.ordering import FCFS
from shared.scheduling.tree_selection import GlobalGreedy
from shared.settings import AugurySettings, SpeculationSettings
from shared.values.methods import DraftMethod


def test_method_from_settings_maps_each_method() -> None:
    spec = SpeculationSettings(
        min_path_prob=0.1,
        chain_length=3,
        static_expansion=(3, 2),
        beam_depth=5,
        beam_width=3,
        dynamic_max_nodes=20,
        dynamic_max_depth=7,
        dynamic_max_width=2,
    )
    expected = {
        "chain": DraftMethod("chain", k=3, min_path_prob=0.1),
        "static": DraftMethod("static", expansion=(3, 2), min_path_prob=0.1),
        "beam": DraftMethod("beam", depth=5, width=3, min_path_prob=0.1),
        "dynamic": DraftMethod(
            "dynamic", budget=20, max_size=20, max_depth=7, max_width=2, min_path_prob=0.1
        ),
    }
    for name, method in expected.items():
        assert method_from_settings(spec.model_copy(update={"method": name})) == method
    assert method_from_settings(spec.model_copy(update={"method": "none"})) is None
    # the defaults: the engine's preset, and its path-probability floor for every method
    assert method_from_settings(SpeculationSettings()) == DEFAULT_METHOD
    assert method_from_settings(SpeculationSettings(method="beam")) == DraftMethod(
        "beam", depth=4, width=2, min_path_prob=DEFAULT_METHOD.min_path_prob
    )


def test_build_core_follows_the_settings() -> None:
    settings = AugurySettings.model_validate(
        {
            "engine": {"max_tokens_per_step": 64},
            "scheduler": {
                "micro_batches": 2,
                "max_running_requests": 7,
                "tree_selection": "global-greedy",
                "speculation": {"method": "static", "planner": "fixed"},
            },
        }
    )
    core = build_core(settings, TargetInfo(96, 256, (2,)), ["d"], None, first_batch_id=5)
    config = core.config
    assert (config.vocab_size, config.max_context, config.eos_token_ids) == (96, 256, (2,))
    assert (config.token_budget, config.max_running, config.micro_batches) == (64, 7, 2)
    assert config.method == DraftMethod(
        "static", expansion=(2, 2, 1, 1), min_path_prob=DEFAULT_METHOD.min_path_prob
    )
    assert config.planner == "fixed"
    assert isinstance(core.policy, FCFS) and isinstance(core.selector, GlobalGreedy)
    off = AugurySettings.model_validate({"scheduler": {"speculation": {"method": "none"}}})
    assert build_core(off, TargetInfo(96, 256), [], None).config.method is None


async def test_replies_hold_the_ack_until_settled() -> None:
    replies: Replies[str] = Replies()
    answer = replies.expect(("mb", 1))
    delivered = asyncio.ensure_future(replies.deliver(("mb", 1), "trees"))
    assert await answer == "trees"
    await asyncio.sleep(0.01)
    assert not delivered.done()  # the entry is not acked before the next hop is written
    replies.settle_where(lambda key: key[0] == "mb")
    await asyncio.wait_for(delivered, 1.0)
    await replies.deliver(("mb", 1), "again")  # a repeat: dropped at once
    assert replies.dropped == 1


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


test_replies_hold_the_ack_until_settled = pytest.mark.anyio(test_replies_hold_the_ack_until_settled)


@pytest.mark.anyio
async def test_preemption_totals_count_each_preemption_once_across_lanes(monkeypatch) -> None:
    """Two lanes count at once: what one is adding must not be added again by the other, and
    what a Redis error kept back is added by the next call."""
    import asyncio
    from collections import Counter
    from types import SimpleNamespace

    from redis.exceptions import ConnectionError as RedisConnectionError

    from services.scheduler import service

    added: Counter[str] = Counter()
    failing = [False]

    async def slow_add(bus, cell, counts):  # noqa: ANN001, ANN202
        await asyncio.sleep(0.01)  # the other lane runs meanwhile
        if failing[0]:
            raise RedisConnectionError("down")
        added.update(counts)

    monkeypatch.setattr(service, "add_preemptions", slow_add)
    scheduler = SimpleNamespace(
        core=SimpleNamespace(preemptions=Counter(recomputed=3, kept=1)),
        _counted_preemptions=Counter(),
        bus=None,
        cell="c",
    )
    count = service.SchedulerService._count_preemptions
    await asyncio.gather(count(scheduler), count(scheduler))
    assert added == Counter(recomputed=3, kept=1)
    failing[0] = True
    scheduler.core.preemptions["recomputed"] += 2
    await count(scheduler)
    failing[0] = False
    await count(scheduler)
    assert added == Counter(recomputed=5, kept=1)
