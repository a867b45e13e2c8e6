"""What the drafter and verifier services share: one consumer group on one job stream, a
heartbeat, and a model thread where every job runs; each answer goes to one reply stream.
Each also publishes its KV-cache usage for the gateway's /metrics (shared/bus/cell_stats.py), and
may refresh a suspect cost profile in the background (services/profile_refresh.py) on its model
thread while its device is quiet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import ClassVar, Generic, TypeVar

from services.profile_refresh import DeviceActivity, ProfileRefresh, device_activity
from services.runtime import ModelThread
from shared.bus import Bus, DeadLetterError, Delivery, Heartbeater, StreamConsumer
from shared.bus.cell_stats import publish_forever, publish_kv_usage
from shared.bus.profiles import TARGET, draft_role
from shared.wire import WireMessage
from shared.wire.streams import VERIFIER

JobT = TypeVar("JobT", bound=WireMessage)
AnswerT = TypeVar("AnswerT", bound=WireMessage)
T = TypeVar("T")
log = logging.getLogger(__name__)


async def _logged(running: Awaitable[T], name: str) -> T | None:
    try:
        return await running
    except Exception:
        log.exception("%s failed; the profile at start stays in force", name)
        return None


class ModelService(Generic[JobT, AnswerT]):
    job_type: ClassVar[type[WireMessage]]

    def __init__(
        self,
        bus: Bus,
        *,
        service: str,
        cell: str,
        model: str,
        job_stream: str,
        reply_stream: str,
    ) -> None:
        self.bus = bus
        self.cell = cell
        self.model = model
        self.stream = job_stream
        self._reply_stream = reply_stream
        self._service = service
        self._thread = ModelThread(f"{service}-{model}")
        self.consumer = StreamConsumer(
            bus, group=service, streams=[job_stream], handler=self.handle
        )
        self.heartbeat = Heartbeater(bus, service=service, cell=cell, model=model, capacity=1)
        self.role = TARGET if service == VERIFIER else draft_role(model)
        self._kv_task: asyncio.Task[None] | None = None
        self._activity: DeviceActivity | None = None
        self.profile_refresh: asyncio.Task[object] | None = None

    @property
    def model_thread(self) -> ModelThread:
        """Where every call into this service's model runs."""
        return self._thread

    @property
    def activity(self) -> DeviceActivity:
        """Forward work on this service's device (shared with this process's other services on
        it; a model-free drafter has its own)."""
        if self._activity is None:
            runner = getattr(self, "runner", None)
            self._activity = (
                device_activity(str(runner.device)) if runner is not None else DeviceActivity()
            )
        return self._activity

    def refresh_profile(self, refresh: ProfileRefresh) -> None:
        """Run `refresh` (its measurements on this service's model thread) until it ends or the
        service stops."""
        name = f"{self._service}-{self.model}-profile-refresh"
        self.profile_refresh = asyncio.create_task(_logged(refresh.run(), name), name=name)

    async def start(self) -> None:
        await self.consumer.start()
        await self.heartbeat.start()
        publishing = publish_forever(
            self.bus.settings.heartbeat_interval_s, self.publish_kv_usage, "the KV-cache usage"
        )
        self._kv_task = asyncio.create_task(publishing, name=f"{self._service}-kv-usage")

    async def stop(self) -> None:
        for task in (self._kv_task, self.profile_refresh):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.heartbeat.stop()
        await self.consumer.stop()
        self._thread.close()

    async def publish_kv_usage(self) -> None:
        runner = getattr(self, "runner", None)  # the verifier's and each drafter's ModelRunner
        if runner is None:
            return
        allocator = runner.cache.allocator  # two ints: read off the model thread, no lock
        total = allocator.num_blocks
        await publish_kv_usage(
            self.bus,
            self.cell,
            self.role,
            self.heartbeat.replica,
            used=total - allocator.num_free,
            total=total,
            ttl_ms=self.bus.settings.heartbeat_ttl_ms,
        )

    async def handle(self, delivery: Delivery) -> None:
        job = delivery.message
        if not isinstance(job, self.job_type):
            raise DeadLetterError(
                f"the {self._service} reads {self.job_type.TYPE} entries, not {job.TYPE}"
            )
        answer = await self.activity.run(self._thread, self.run_job, job)
        if answer is not None:
            await self.bus.publish(self._reply_stream, answer)

    def run_job(self, job: JobT) -> AnswerT | None:
        """On the model thread: drop the released requests, then answer the job's entries."""
        for request_id in job.release:  # type: ignore[attr-defined]
            self.forget(request_id)
        if not job.entries:  # type: ignore[attr-defined]
            return None
        return self.answer(job)

    def forget(self, request_id: str) -> None:
        """Free everything held for a request (its KV, its last answer)."""
        raise NotImplementedError

    def answer(self, job: JobT) -> AnswerT:
        raise NotImplementedError
