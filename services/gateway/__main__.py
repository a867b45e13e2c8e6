"""Run a gateway replica: `python -m services.gateway` (settings from AUGURY_* variables)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from aiohttp import web

from services.gateway.app import Gateway, routing_rules
from shared.bus import Bus, Heartbeater, redis_url
from shared.settings import AugurySettings, load_settings
from shared.wire.streams import GATEWAY


def target_dir(settings: AugurySettings) -> Path:
    from shared.model.loader import checkpoint_dir
    from shared.model.model_set import model_set_target

    return checkpoint_dir(settings.models.target_dir or model_set_target(settings.models.model_set))


async def serve(settings: AugurySettings, url: str) -> None:
    from transformers import AutoTokenizer

    checkpoint = target_dir(settings)
    # off the event loop: in `services all` the scheduler's lease renewals share this loop
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    max_context = settings.engine.max_context or int(config["max_position_embeddings"])
    bus = Bus(url, settings.redis, settings.service.replica)
    gateway = Gateway(settings, bus, tokenizer, vocab_size=len(tokenizer), max_context=max_context)
    runner = web.AppRunner(gateway.app())
    await runner.setup()
    site = web.TCPSite(runner, settings.gateway.host, settings.gateway.port)
    # one heartbeat in each cell it routes to: a scheduler answers its cell's live gateways only
    heartbeats = [
        Heartbeater(
            bus,
            service=GATEWAY,
            cell=cell,
            model=settings.gateway.model_name,
            capacity=settings.gateway.max_concurrent_requests,
            in_flight=lambda: gateway.active,
        )
        for cell in routing_rules(settings).cells
    ]
    for heartbeat in heartbeats:
        await heartbeat.start()  # before the first request
    await site.start()
    logging.getLogger(__name__).info(
        "gateway %s on %s:%d", bus.consumer_name, settings.gateway.host, settings.gateway.port
    )
    try:
        await asyncio.Event().wait()
    finally:
        for heartbeat in heartbeats:
            await heartbeat.stop()
        await runner.cleanup()
        await bus.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    settings = load_settings()
    with redis_url(settings.redis) as url:
        asyncio.run(serve(settings, url))


if __name__ == "__main__":
    main()
