"""Helpers for the services tests: settings, a client that talks to the scheduler over Redis
the way a gateway does, plain greedy references, and a stack of services in this process.

(No tests here; pytest collects the module and finds none.)
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.run import Stack, start_stack
from services.runtime import ModelPaths
from shared.bus import Bus, Heartbeater
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.settings import AugurySettings, RedisSettings
from shared.values.logprobs import EMPTY, TokenLogprobs
from shared.values.sampling import SamplingParams
from shared.wire import Cancel, FinishReason, RequestError, Submit, Tokens, decode_entry
from shared.wire.streams import GATEWAY, output_stream, requests_stream

FAST_REDIS = {"block_ms": 100, "claim_idle_ms": 2000, "heartbeat_ttl_ms": 1500}
# Mechanics tests: no cost profile (none stored where they look, none measured) and every tree
# drafted whole (planner "fixed", no path-probability floor: a random tiny draft's guesses are
# all below the default's 0.2), so that a test can count accepted tokens; tests of the default
# pass their own groups.
NO_PROFILES = Path(tempfile.gettempdir()) / "augury-tests-no-profiles"
TINY_ENGINE = {
    "block_size": 4,
    "kv_memory_bytes": 4 << 20,
    "measure_profile": False,
    "profile_dir": NO_PROFILES,
    "profile_cache_dir": NO_PROFILES,
    # drafts keep their fp32 weights: a self-draft then accepts every token, which the tests
    # assert (int8 drafts, the CPU default, have tests of their own: tests/test_int8_drafts.py)
    "draft_weights": "native",
}
FIXED_SPECULATION = {"planner": "fixed", "min_path_prob": 0.0}


def make_settings(url: str, cell: str, **groups: Any) -> AugurySettings:
    engine = {**TINY_ENGINE, **groups.pop("engine", {})}
    scheduler = dict(groups.pop("scheduler", {}))
    scheduler["speculation"] = {**FIXED_SPECULATION, **scheduler.get("speculation", {})}
    return AugurySettings(
        redis=RedisSettings(url=url, **FAST_REDIS),
        engine=engine,
        scheduler=scheduler,
        service={"cell": cell, "replica": cell},
        **groups,
    )


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    chunks: int = 0
    finish: FinishReason | None = None
    error: RequestError | None = None
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    logprobs: TokenLogprobs | None = None  # of `tokens`, when asked for

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None


class Client:
    """Submits to a cell's request stream and reads its own output stream, like a gateway; it
    beats as a gateway replica (the scheduler answers live gateways only)."""

    def __init__(self, url: str, settings: AugurySettings, name: str) -> None:
        self.bus = Bus(url, settings.redis, name)
        self.cell = settings.service.cell
        self.reply_to = output_stream(self.cell, name)
        self.heartbeat = Heartbeater(self.bus, service=GATEWAY, cell=self.cell)
        self.outcomes: dict[str, Outcome] = {}
        self._last = "0-0"
        self.stack: Stack | None = None  # for a description of the services when stuck

    async def close(self) -> None:
        await self.heartbeat.stop()
        await self.bus.close()

    async def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, **extra: Any
    ) -> None:
        if not self.heartbeat.is_beating:
            await self.heartbeat.start()
        self.outcomes[request_id] = Outcome()
        submit = Submit(request_id, tuple(prompt), params, self.reply_to, time.time(), **extra)
        await self.bus.publish(requests_stream(self.cell), submit)

    async def cancel(self, request_id: str) -> None:
        await self.bus.publish(requests_stream(self.cell), Cancel(request_id))

    async def poll(self, block_ms: int = 200) -> list[Tokens | RequestError]:
        """Read what arrived; checks that every request's tokens come in order, once."""
        reply = await self.bus.redis.xread({self.reply_to: self._last}, count=500, block=block_ms)
        messages = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._last = entry_id.decode()
                message = decode_entry(fields)
                assert isinstance(message, Tokens | RequestError)
                outcome = self.outcomes[message.request_id]
                assert not outcome.done, f"{message.request_id}: output after it finished"
                if isinstance(message, RequestError):
                    outcome.error = message
                else:
                    assert message.offset == len(outcome.tokens), "a gap or a repeated token"
                    outcome.tokens.extend(message.token_ids)
                    outcome.chunks += 1
                    outcome.finish = message.finish
                    outcome.drafts += message.drafts
                    outcome.draft_tokens += message.draft_tokens
                    outcome.accepted_tokens += message.accepted_tokens
                    if message.logprobs is not None:
                        outcome.logprobs = (outcome.logprobs or EMPTY) + message.logprobs
                messages.append(message)
        return messages

    async def wait(self, request_ids: Sequence[str], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self.outcomes[r].done for r in request_ids):
            if time.monotonic() > deadline:
                progress = {r: len(self.outcomes[r].tokens) for r in request_ids}
                state = describe(self.stack) if self.stack is not None else ""
                raise AssertionError(f"requests did not finish in time: {progress}\n{state}")
            await self.poll()


async def until(predicate: Any, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(
    url: str,
    cell: str,
    models: ModelPaths,
    *,
    drafter_replicas: int = 1,
    **groups: Any,
) -> AsyncIterator[tuple[Stack, Client]]:
    """Verifier, drafters and scheduler in this process (no gateway), and a client."""
    settings = make_settings(url, cell, **groups)
    stack = await start_stack(
        settings, url, models, gateway=False, drafter_replicas=drafter_replicas
    )
    client = Client(url, settings, f"{cell}-client")
    client.stack = stack
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks, stack)  # kill -USR1 <pid> when stuck
    try:
        yield stack, client
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        await client.close()
        await stack.stop()


def dump_tasks(stack: Stack) -> None:
    print(describe(stack), file=sys.stderr)
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)


def describe(stack: Stack) -> str:
    """The services' state, for a test that got stuck."""
    lines = []
    scheduler = stack.scheduler
    if scheduler is not None:
        lines.append(f"scheduler {scheduler.stats}")
        lines += [
            f"  running {r.request_id} step {r.step} out {len(r.output)} in_flight {r.in_flight} "
            f"prefilled {r.num_prefilled}/{len(r.prefill_tokens)} drafter {r.drafter}"
            for r in scheduler.running
        ]
        lines.append(f"  waiting {[r.request_id for r in scheduler.waiting]}")
        lines.append(f"  drafters {scheduler.drafters.replicas} load {scheduler.drafters.load()}")
        lines.append(f"  lanes {[(t.get_name(), t.done()) for t in scheduler._lanes]}")
    consumers = [*(scheduler.consumers if scheduler else [])]
    consumers += [stack.verifier.consumer] if stack.verifier else []
    consumers += [d.consumer for d in stack.drafters]
    for c in consumers:
        lines.append(
            f"  {c.streams} busy {c._busy} queued {c._queue.qsize()} {c.stats} "
            f"crashed {c.crashed!r}"
        )
    return "\n".join(lines)


def plain_greedy(
    target: Path, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
) -> list[list[int]]:
    """Plain greedy decoding of the target by the in-process engine (no draft)."""
    runner = ModelRunner(load_model(target), block_size=4, kv_memory_bytes=16 << 20)
    eos = runner.cfg.eos_token_ids
    engine = SpecEngine(Verifier(runner), eos_token_ids=eos)
    return [r.output for r in engine.generate(prompts, list(params))]
