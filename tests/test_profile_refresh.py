"""A model service that starts with a suspect cost profile measures again in the background
(services/profile_refresh.py): once its device is quiet, on its model thread; a trusted result
is cached, published and reported as in force; a device that stays busy keeps the suspect one.

Real quick measurements of a tiny model throughout; a busy device is the `BusyDevice` of
tests/test_profile_trust.py (some forwards wait, as when a neighbour holds the device)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import services.run
from services.drafter.service import DrafterService
from services.gateway.metrics import GatewayMetrics, export_profile_statuses
from services.run import Stack, publish_own_profile, start_profile_refresh
from services.runtime import load_runner
from shared.bus import Bus, EmbeddedRedis
from shared.bus.profiles import draft_role, read_profile_statuses, read_profiles
from shared.model.cost_profiles import MEASURED, SUSPECT, ProfileChoice, choose_profile
from shared.settings import AugurySettings, EngineSettings
from tests.conftest import make_tiny_checkpoint
from tests.test_profile_trust import BusyDevice, target_like
from tests.test_services_support import make_settings

ROLE = draft_role("draft-m")


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("refresh"), seed=2, num_layers=1)
    return load_runner(path, EngineSettings(kv_memory_bytes=1 << 20, block_size=4))


def small_forwards(tokens: int, count: int) -> bool:
    return tokens <= 4  # the few-token forwards wait: more tokens look cheaper, suspect


def settings_for(server: EmbeddedRedis, tmp_path: Path, cell: str, **engine: Any) -> AugurySettings:
    return make_settings(
        server.url,
        cell,
        engine={
            "measure_profile": True,
            "profile_dir": tmp_path / "none",
            "profile_cache_dir": tmp_path / "cache",
            "plan_kernels": False,
            "profile_refresh_idle_s": 0.3,
            "profile_refresh_backoff_s": 0.05,
            **engine,
        },
    )


# A tiny model's forwards take about a millisecond, so the other test worker's load can make a
# background measurement's repeats disagree: the cases that expect a trusted result try for about
# 10 s (0.3 s doubling) before they give up, as a deployment retries over minutes.
PATIENT = {"profile_refresh_tries": 6, "profile_refresh_backoff_s": 0.3}


def cached(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache").glob("*.json")) if (tmp_path / "cache").exists() else []


@contextlib.asynccontextmanager
async def suspect_service(
    settings: AugurySettings, server: EmbeddedRedis, runner: Any
) -> AsyncIterator[tuple[DrafterService, ProfileChoice, BusyDevice]]:
    """A drafter service whose profile at start was measured on a busy device (`runner.forward`
    is the `BusyDevice` until a test deletes it), with its background refresh started; stopped
    and its runner restored on exit."""
    busy = BusyDevice(runner, 0.05, small_forwards)
    stack = Stack(settings, server.url)
    stack.target_profile = target_like(runner)  # this process's verifier's
    cell = settings.service.cell
    service = DrafterService(
        Bus(server.url, settings.redis, cell), runner, model="draft-m", cell=cell
    )
    runner.forward = busy
    try:
        choice = await publish_own_profile(stack, service.bus, runner, "draft-m", ROLE)
        await service.start()
        assert start_profile_refresh(stack, service, choice, ROLE)
        yield service, choice, busy
    finally:
        if "forward" in vars(runner):
            del runner.forward
        await service.stop()
        await service.bus.close()


async def published_state(bus: Bus, cell: str) -> tuple[dict[str, Any], dict[str, str]]:
    profiles = await read_profiles(bus, cell)
    statuses = await read_profile_statuses(bus, cell)
    return profiles, statuses[ROLE]


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start's retries without the 5 s waits between them."""
    monkeypatch.setattr(
        services.run, "choose_profile", functools.partial(choose_profile, retry_wait_s=0.0)
    )


def test_a_suspect_profile_is_replaced_once_the_device_is_quiet(
    runner: Any,
    tmp_path: Path,
    server: EmbeddedRedis,
    caplog: pytest.LogCaptureFixture,
    quick_retries: None,
) -> None:
    settings = settings_for(server, tmp_path, "refresh", **PATIENT)
    caplog.set_level(logging.INFO)

    async def run() -> None:
        async with suspect_service(settings, server, runner) as (service, choice, busy):
            del runner.forward  # the neighbour is gone
            assert choice.source == SUSPECT and busy.waited > 0
            profiles, status = await published_state(service.bus, settings.service.cell)
            assert ROLE not in profiles and (status["source"], status["published"]) == (
                SUSPECT,
                "0",
            )
            assert not cached(tmp_path)
            assert service.profile_refresh is not None
            refreshed = await asyncio.wait_for(service.profile_refresh, 120)
            assert isinstance(refreshed, ProfileChoice) and refreshed.source == MEASURED
            profiles, status = await published_state(service.bus, settings.service.cell)
            assert profiles[ROLE] == refreshed.profile  # the scheduler's cost model reads this
            assert (status["source"], status["published"]) == (MEASURED, "1")
            metrics = GatewayMetrics()
            export_profile_statuses(metrics, {"refresh": {ROLE: status}})
            labels = {"cell": "refresh", "role": ROLE, "source": MEASURED, "published": "1"}
            assert metrics.registry.get_sample_value("augury_cost_profile_info", labels) == 1.0

    asyncio.run(run())
    assert len(cached(tmp_path)) == 1  # the next start loads it
    assert "measuring again in the background (try 1 of 6" in caplog.text
    assert "checked and kept" in caplog.text and "is in force and published" in caplog.text
    assert "ms per forward by tokens at context 0" in caplog.text  # what it measured


def test_a_device_that_stays_busy_keeps_the_suspect_profile(
    runner: Any,
    tmp_path: Path,
    server: EmbeddedRedis,
    caplog: pytest.LogCaptureFixture,
    quick_retries: None,
) -> None:
    settings = settings_for(server, tmp_path, "refresh-busy", profile_refresh_tries=2)
    caplog.set_level(logging.INFO)

    async def run() -> None:
        async with suspect_service(settings, server, runner) as (service, choice, _):
            assert choice.source == SUSPECT
            assert service.profile_refresh is not None
            assert await asyncio.wait_for(service.profile_refresh, 120) is None
            profiles, status = await published_state(service.bus, settings.service.cell)
            assert ROLE not in profiles and (status["source"], status["published"]) == (
                SUSPECT,
                "0",
            )

    asyncio.run(run())
    assert not cached(tmp_path)
    assert "background measurement 1 of 2 not kept" in caplog.text
    assert "2 background measurement(s), none trusted" in caplog.text
    assert caplog.text.count("NOT kept") == 3  # the start's, and each background try's


def test_the_refresh_waits_while_forwards_keep_coming(
    runner: Any, tmp_path: Path, server: EmbeddedRedis, quick_retries: None
) -> None:
    """Work every 0.1 s on the model thread (through the service's device activity, as each job
    runs) keeps the device from being quiet for 0.3 s: no measurement until it stops."""
    settings = settings_for(server, tmp_path, "refresh-waits", **PATIENT)

    async def run() -> None:
        async with suspect_service(settings, server, runner) as (service, _, _):
            del runner.forward
            measured_at: list[float] = []
            measuring: Callable[..., Any] = runner.forward

            def timed(*args: Any, **kwargs: Any) -> Any:
                measured_at.append(time.monotonic())
                return measuring(*args, **kwargs)

            runner.forward = timed
            stop_at = time.monotonic() + 1.5
            while time.monotonic() < stop_at:
                await service.activity.run(service.model_thread, time.sleep, 0.02)
                await asyncio.sleep(0.08)
            last_work = service.activity.last_end
            assert service.profile_refresh is not None
            refreshed = await asyncio.wait_for(service.profile_refresh, 120)
            assert isinstance(refreshed, ProfileChoice) and refreshed.source == MEASURED
            assert measured_at and min(measured_at) >= last_work + 0.3

    asyncio.run(run())
