"""One verifier per cell: a second one (`--scale verifier=2`) is refused with a clear log line
and waits as a standby until the first stops, instead of splitting the cell's verify stream."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.run import Stack, start_verifier, verifier_lease_key
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from tests.test_replay import models  # noqa: F401 (a fixture)
from tests.test_services_support import make_settings

pytestmark = pytest.mark.anyio


async def test_a_second_verifier_waits_as_a_standby(
    server: EmbeddedRedis,
    models: ModelPaths,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings(server.url, "lease", scheduler={"lease_ttl_ms": 600})
    first, second = Stack(settings, server.url), Stack(settings, server.url)
    caplog.set_level(logging.INFO)
    try:
        await start_verifier(first, models, "host-a-1")
        standby = asyncio.create_task(start_verifier(second, models, "host-b-2"))
        await asyncio.sleep(1.5)  # past the lease's TTL: the first one renews it
        assert not standby.done() and second.verifier is None
        assert "cell lease already has a verifier (host-a-1)" in caplog.text
        assert "verifier host-b-2 waits as a standby" in caplog.text
        holder = await first.buses[0].redis.get(verifier_lease_key("lease"))
        assert holder == b"host-a-1"
        await first.stop()  # a clean stop gives the lease up at once
        await asyncio.wait_for(standby, timeout=30)
        assert second.verifier is not None and not second.lease_lost.is_set()
        holder = await second.buses[0].redis.get(verifier_lease_key("lease"))
        assert holder == b"host-b-2"
    finally:
        await first.stop()
        await second.stop()
