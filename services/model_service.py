"""What the drafter and verifier services share: one consumer group on one job stream, a
heartbeat, and a model thread where every job runs; each answer goes to one reply stream."""

from __future__ import annotations

from typing import ClassVar, Generic, TypeVar

from services.runtime import ModelThread
from shared.bus import Bus, DeadLetterError, Delivery, Heartbeater, StreamConsumer
from shared.wire import WireMessage

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

    async def start(self) -> None:
        await self.consumer.start()
        await self.heartbeat.start()

    async def stop(self) -> None:
        await self.heartbeat.stop()
        await self.consumer.stop()
        self._thread.close()

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
