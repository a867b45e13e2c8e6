"""What the drafter and verifier services share: one consumer group on one job stream, a
heartbeat, and a model thread where every job runs; each answer goes to one reply stream.
Each also publishes its KV-cache usage for the gateway's /metrics (shared/bus/cell_stats.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import ClassVar, Generic, TypeVar

from services.runtime import ModelThread
from shared.bus import Bus, DeadLetterError, Delivery, Heartbeater, StreamConsumer
from shared.bus.cell_stats import publish_forever, publish_kv_usage
from shared.bus.profiles import TARGET, draft_role
from shared.wire import WireMessage
from shared.wire.streams import VERIFIER

JobT = TypeVar("JobT", bound=WireMessage)
AnswerT = TypeVar("AnswerT", bound=WireMessage)


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

    async def start(self) -> None:
        await self.consumer.start()
        await self.heartbeat.start()
        publishing = publish_forever(
            self.bus.settings.heartbeat_interval_s, self.publish_kv_usage, "the KV-cache usage"
        )
        self._kv_task = asyncio.create_task(publishing, name=f"{self._service}-kv-usage")

    async def stop(self) -> None:
        if self._kv_task is not None:
            self._kv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._kv_task
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
        answer = await self._thread.run(self.run_job, job)
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
