"""The scheduler service: the scheduler core driven over Redis streams (DESIGN: a request's life).

Every decision is the core's (`shared.scheduling.core.SchedulerCore`), the same object the
in-process engine drives; this executor turns its plans into messages. M lanes run at once, each
carrying one micro-batch at a time through its stages (Spin §V-B): while one micro-batch is being
verified, drafters speculate another. One lane's iteration:

1. `core.next_batch`: who decodes, who prefills how much, who is admitted or preempted, and
   what each request's drafter is asked for;
2. send one DraftJob per drafter replica (deltas of committed tokens), await CandidateTrees;
3. `core.select_trees`; send one VerifyJob, await its VerifyResult;
4. `core.observe`: commit tokens, apply stops; append Tokens to each request's output stream and
   release what finished.

Every answer is matched by (micro-batch, request, step): a stale or repeated answer changes
nothing. The scheduler touches token ids and counters only, never tensors.

One scheduler serves a cell at a time: it holds the cell's lease (`shared.bus.lease`) and keeps
its requests in Redis as they change (`services.scheduler.store`): each accepted Submit before it
is acknowledged, each request's committed tokens in the same transaction as the Tokens that
carry them. A restarted scheduler, or a standby, takes the lease once the holder stops renewing
it and resumes every stored request where its client's stream stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.scheduler.drafters import DrafterDirectory
from services.scheduler.gateways import GatewayDirectory
from services.scheduler.replies import Replies
from services.scheduler.store import REMEMBER_FINISHED, RequestStore, StoredRequest
from shared.bus import Bus, DeadLetterError, Delivery, Heartbeater, StreamConsumer
from shared.bus.cell_stats import QueueTimes, publish_forever, publish_scheduler_stats
from shared.bus.lease import Lease
from shared.bus.preemptions import add_preemptions
from shared.errors import ContextLengthError, InvalidRequestError
from shared.scheduling.core import DraftTiming, MicroBatch, StepOutput, mean_context
from shared.scheduling.executor import (
    Drafted,
    DraftKey,
    DraftRound,
    Resolved,
    check_draft_model,
    new_request,
    resolve,
    route_releases,
    step_results,
    verify_requests,
)
from shared.scheduling.executor import DraftJob as RoundJob
from shared.scheduling.factory import TargetInfo, build_core
from shared.scheduling.request import AcceptanceStats, RequestState
from shared.settings import AugurySettings
from shared.wire import (
    Cancel,
    CandidateTrees,
    DraftedTree,
    DraftJob,
    FinishReason,
    RequestError,
    Submit,
    Tokens,
    VerifiedRequest,
    VerifyJob,
    VerifyResult,
    WireMessage,
)
from shared.wire.streams import (
    SCHEDULER,
    candidates_stream,
    draft_stream,
    requests_stream,
    results_stream,
    scheduler_lease_key,
    verify_stream,
)

log = logging.getLogger(__name__)

RELEASE_ONLY = 0  # micro-batch id of jobs that only release state (nobody waits for an answer)
VERIFY_ATTEMPTS = 3
IDLE_POLL_S = 1.0
STOP_POLL_S = 1.0
PUBLISH_RETRY_MAX_S = 2.0
FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ABORT,
}


@dataclass
class SchedulerStats:
    iterations: int = 0
    wall_ms: float = 0.0  # whole iterations, summed
    draft_ms: float = 0.0  # drafting as the drafters measured it (slowest replica per step)
    verify_ms: float = 0.0  # verification as the verifier measured it
    draft_timeouts: int = 0
    verify_resends: int = 0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)

    @property
    def hop_ms_per_iteration(self) -> float:
        """Per-iteration time outside the models: Redis hops, (de)serialization, scheduling."""
        if not self.iterations:
            return 0.0
        return (self.wall_ms - self.draft_ms - self.verify_ms) / self.iterations


def _slo_statistics(out: StepOutput, request: RequestState | None) -> dict[str, Any]:
    """A finishing request's class, objective and measured TPOT, as Tokens fields."""
    if request is None or out.finish_reason not in ("stop", "length"):
        return {}
    return {
        "slo_class": request.slo_class,
        "tpot_slo_ms": request.tpot_slo_ms,
        "tpot_ms": request.tpot_ms,
        "cached_tokens": request.num_cached_prompt_tokens,
    }


class ReleaseJobs:
    """The service's `Releaser`: each release as a release-only job to the verifier or to one
    drafter replica."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service
        self.messages: list[tuple[str, WireMessage]] = []

    def free_target(self, request_id: str) -> None:
        job = VerifyJob(RELEASE_ONLY, (), (request_id,))
        self.messages.append((verify_stream(self.service.cell), job))
        self.service._forget(request_id)

    def free_draft(self, model: str, replica: str, request_id: str) -> None:
        stream = draft_stream(self.service.cell, model, replica)
        self.messages.append((stream, DraftJob(RELEASE_ONLY, (), (request_id,))))


class SchedulerService:
    def __init__(
        self,
        settings: AugurySettings,
        bus: Bus,
        target: TargetInfo,
        *,
        draft_models: Sequence[str] = (),
    ) -> None:
        config = settings.scheduler
        self.bus = bus
        self.cell = settings.service.cell
        self.draft_models = list(draft_models)
        self.slo = config.slo
        # no cost model yet: the directory builds it from the profiles the model services publish
        self.core = build_core(
            settings, target, self.draft_models, cost=None, first_batch_id=secrets.randbits(40) + 1
        )
        self.drafters = DrafterDirectory(bus, self.cell, self.core)
        self.gateways = GatewayDirectory(bus, self.cell, on_refresh=self._cancel_orphans)
        self.draft_timeout_s = config.draft_timeout_s
        self.verify_timeout_s = config.verify_timeout_s
        self.reply_to: dict[str, str] = {}  # request id -> its output stream
        self.stats = SchedulerStats(acceptance=self.core.stats)
        self._counted_preemptions: Counter[str] = Counter()  # added to the cell's totals
        self._queue_times = QueueTimes()  # since the last stats write (shared/bus/cell_stats.py)
        self._dequeued: OrderedDict[str, None] = OrderedDict()  # queue time already counted
        self._stats_task: asyncio.Task[None] | None = None
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._candidates: Replies[CandidateTrees] = Replies()
        self._results: Replies[VerifyResult] = Replies()
        self._lanes: list[asyncio.Task[None]] = []
        self.store = RequestStore(bus, self.cell)
        self.lease = Lease(
            bus, scheduler_lease_key(self.cell), bus.consumer_name, config.lease_ttl_ms
        )
        self.lease_lost = asyncio.Event()  # set when another scheduler took the cell over
        self._lease_keeper: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()  # stores commit in the order the core made them
        concurrency = 64 * self.core.config.micro_batches
        self.consumers = [
            StreamConsumer(
                bus,
                group=SCHEDULER,
                streams=[requests_stream(self.cell)],
                handler=self.handle_request,
                concurrency=16,
            ),
            StreamConsumer(
                bus,
                group=SCHEDULER,
                streams=[candidates_stream(self.cell)],
                handler=self.handle_candidates,
                concurrency=concurrency,
            ),
            StreamConsumer(
                bus,
                group=SCHEDULER,
                streams=[results_stream(self.cell)],
                handler=self.handle_results,
                concurrency=concurrency,
            ),
        ]
        self.heartbeat = Heartbeater(
            bus,
            service=SCHEDULER,
            cell=self.cell,
            capacity=config.max_running_requests,
            in_flight=lambda: len(self.core.running),
        )

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.core.requests

    @property
    def running(self) -> list[RequestState]:
        return self.core.running

    @property
    def waiting(self) -> list[RequestState]:
        return self.core.waiting

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the cell's lease (waiting while another scheduler holds it), resume the stored
        requests, then serve."""
        await self.lease.take(on_wait=self._log_waiting)
        self._lease_keeper = asyncio.create_task(self._keep_lease(), name="scheduler-lease")
        await self._resume()
        await self.gateways.start()
        await self.drafters.start()
        for consumer in self.consumers:
            await consumer.start()
        self._lanes = [
            asyncio.create_task(self._lane(), name=f"scheduler-lane-{i}")
            for i in range(self.core.config.micro_batches)
        ]
        await self.heartbeat.start()
        publishing = publish_forever(
            self.bus.settings.heartbeat_interval_s, self._publish_stats, "the scheduler's stats"
        )
        self._stats_task = asyncio.create_task(publishing, name="scheduler-stats")

    async def stop(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
        if self._lease_keeper is not None:
            self._lease_keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease_keeper
        await self.heartbeat.stop()
        while any(not lane.done() for lane in self._lanes):
            for lane in self._lanes:
                lane.cancel()
            await asyncio.wait(self._lanes, timeout=STOP_POLL_S)
        self._candidates.settle_all()
        self._results.settle_all()
        for consumer in self.consumers:
            await consumer.stop()
        await self.drafters.stop()
        await self.gateways.stop()
        if not self.lease_lost.is_set():  # the successor takes over at once, not after the TTL
            with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
                await self.lease.release()

    def _log_waiting(self, holder: str | None) -> None:
        log.info(
            "waiting for scheduler %s to give up cell %s (lease %s)",
            holder,
            self.cell,
            self.lease.key,
        )

    async def _keep_lease(self) -> None:
        reason = await self.lease.keep()
        log.error("%s: this scheduler stops serving cell %s", reason, self.cell)
        self.lease_lost.set()
        for lane in self._lanes:  # no more steps, no more writes: the cell is someone else's
            lane.cancel()

    async def _resume(self) -> None:
        """Take over the requests a previous scheduler stored, where their clients are."""
        stored, broken, finished = await self.store.load()
        for rid in finished:
            self._remember(rid)
        for rid in broken:  # logged by the store; nobody can be told (no readable reply_to)
            self.store.stage_finished(rid)
        messages: list[tuple[str, WireMessage]] = []
        for item in stored:
            messages += self._resume_one(item)
        await self._publish(messages)
        if stored:
            log.info("resumed %d requests of cell %s", len(stored), self.cell)
        self._notify()

    def _resume_one(self, item: StoredRequest) -> list[tuple[str, WireMessage]]:
        submit = item.submit
        rid = submit.request_id
        try:
            request = self._request_of(submit, item.resolved)
            if item.progress is not None:
                item.progress.apply(request)
            self.core.add(request)
        except InvalidRequestError as error:  # e.g. its draft model is configured no longer
            self.store.stage_finished(rid)
            self._remember(rid)
            return [
                (submit.reply_to, RequestError(rid, "invalid_request", str(error), error.param))
            ]
        self.reply_to[rid] = submit.reply_to
        draft = item.progress.draft if item.progress is not None else None
        if draft is None:
            return []
        model, replica = draft  # free the draft KV it had; a new replica will be matched
        return [(draft_stream(self.cell, model, replica), DraftJob(RELEASE_ONLY, (), (rid,)))]

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    # ---- the request stream ----------------------------------------------------------------
    async def handle_request(self, delivery: Delivery) -> None:
        if self.lease_lost.is_set():  # left pending: the cell's scheduler now claims it
            raise RuntimeError(f"this scheduler no longer serves cell {self.cell}")
        message = delivery.message
        if isinstance(message, Submit):
            await self._submit(message)
        elif isinstance(message, Cancel):
            await self._publish(self.cancel(message.request_id))
        else:
            raise DeadLetterError(
                f"the request stream carries submit and cancel, not {message.TYPE}"
            )

    async def _submit(self, submit: Submit) -> None:
        rid = submit.request_id
        if rid in self.core.requests or rid in self._finished:
            return  # a redelivered Submit
        # never write where a Submit says at will: only to a live gateway's output stream
        if not await self.gateways.is_live(submit.reply_to):
            log.warning(
                "dropping %s: reply_to %r is no live gateway's output stream", rid, submit.reply_to
            )
            self._remember(rid)
            return
        try:
            request = self._request_of(submit)
            self.core.add(request)
        except InvalidRequestError as error:
            self._remember(rid)
            code = (
                "context_length_exceeded"
                if isinstance(error, ContextLengthError)
                else "invalid_request"
            )
            refusal = RequestError(rid, code, str(error), error.param)
            await self.bus.publish(submit.reply_to, refusal)
            return
        self.reply_to[rid] = submit.reply_to
        resolved = Resolved(request.seed, request.tpot_slo_ms, request.slo_class)
        self.store.stage_submit(submit, resolved)
        await self._publish([])  # stored before the Submit is acknowledged
        self._notify()

    def _request_of(self, submit: Submit, resolved: Resolved | None = None) -> RequestState:
        """The core's state of a request (new, or `resolved` before a takeover);
        InvalidRequestError for what cannot be served."""
        check_draft_model(submit.draft_model, self.draft_models, param="augury.draft_model")
        if resolved is None:
            # the cost model may still be None: a class objective then needs
            # slo.baseline_latency_ms
            resolved = resolve(
                submit.sampling, submit.slo_class, submit.tpot_slo_ms, self.slo, self.core.cost
            )
        return new_request(
            submit.request_id,
            submit.prompt,
            submit.sampling,
            resolved,
            arrival_time=submit.arrival_time,
            priority=submit.priority,
            requested_draft=submit.draft_model,
            speculate=submit.speculate,
            app=submit.app,
        )

    async def _cancel_orphans(self) -> None:
        """Cancel the requests whose gateway stopped beating: their clients are gone. Each is
        told why on its stream all the same, so a gateway that was only stalled answers its
        client at once instead of waiting out its idle timeout."""
        orphans = [
            (rid, stream)
            for rid, stream in self.reply_to.items()
            if self.gateways.gone(stream) and not self._cancelled(rid)
        ]
        if not orphans:
            return
        log.warning("cancelling %d requests whose gateway stopped beating", len(orphans))
        messages: list[tuple[str, WireMessage]] = []
        for rid, stream in orphans:
            why = "the scheduler cancelled this request: its gateway stopped beating"
            messages += [(stream, RequestError(rid, "gateway_lost", why)), *self.cancel(rid)]
        await self._publish(messages)

    def _cancelled(self, request_id: str) -> bool:
        request = self.core.requests.get(request_id)
        return request is None or request.cancelled

    def cancel(self, request_id: str) -> list[tuple[str, WireMessage]]:
        """Stop a request; free its state now, or when its micro-batch comes back."""
        self.core.cancel(request_id)
        return self._releases()

    # ---- answers ---------------------------------------------------------------------------------
    async def handle_candidates(self, delivery: Delivery) -> None:
        message = delivery.message
        if not isinstance(message, CandidateTrees):
            raise DeadLetterError(f"the candidates stream carries trees, not {message.TYPE}")
        await self._candidates.deliver((message.micro_batch_id, message.replica), message)

    async def handle_results(self, delivery: Delivery) -> None:
        message = delivery.message
        if not isinstance(message, VerifyResult):
            raise DeadLetterError(f"the results stream carries results, not {message.TYPE}")
        await self._results.deliver(message.micro_batch_id, message)

    # ---- the loop --------------------------------------------------------------------------------
    async def _lane(self) -> None:
        while True:
            wake = self._wake
            batch = self.core.next_batch(time.time())
            if batch is None:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                # that arrives as the wait completes, and the lane would never stop
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_POLL_S):
                        await wake.wait()
                continue
            try:
                await self._iterate(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("micro-batch %d failed; its requests retry", batch.id)
                await asyncio.sleep(0.1)
            finally:
                # not `in_flight = False` for its members: once observed, a member may already
                # be in flight in another lane's micro-batch
                self.core.abandon(batch)
                self._notify()

    async def _iterate(self, batch: MicroBatch) -> None:
        started = time.perf_counter()
        self._observe_queue_times(batch)
        try:
            await self._publish(self._outputs(batch.failed) + self._releases())
            await self._count_preemptions()  # the core's, up to this batch
            if batch.is_empty:
                return
            drafted, draft_ms, timings = await self._draft(batch)
            trees = self.core.select_trees(batch, drafted.trees, time.time(), drafted.partners)
            job = VerifyJob(batch.id, verify_requests(self.core, batch, trees))
            result = await self._verify(job)
            self.core.note_costs(batch, timings, result.verify_ms or None)
            results = step_results(result.entries)
            outputs = self.core.observe(batch, results, time.time())
            members = {r.request_id: r for r in batch.members}
            for rid, request in members.items():
                if rid in self.core.requests:
                    self.store.stage_progress(request)
            await self._publish(self._outputs(outputs, members) + self._releases())
        finally:  # whatever happened, let the answers' entries be acknowledged
            self._candidates.settle_where(lambda key: key[0] == batch.id)
            self._results.settle(batch.id)
        wall_ms = 1000 * (time.perf_counter() - started)
        self.stats.iterations += 1
        self.stats.wall_ms += wall_ms
        self.stats.draft_ms += draft_ms
        self.stats.verify_ms += result.verify_ms
        if log.isEnabledFor(logging.DEBUG):  # its sums walk the batch: only when it is read
            committed = sum(len(r.tokens) for r in results.values() if r.error is None)
            self._log_step(batch, committed, draft_ms, result.verify_ms, wall_ms)

    @staticmethod
    def _log_step(
        batch: MicroBatch, committed: int, draft_ms: float, verify_ms: float, wall_ms: float
    ) -> None:
        """One micro-batch's timings; tools.sim.calibrate fits the simulator's overheads on them."""
        log.debug(
            "micro-batch %d: %d decoding (%d tree nodes, %d planned drafts), %d prefilling "
            "(%d tokens), context %d, %d tokens committed; draft %.1f ms, verify %.1f ms, "
            "step %.1f ms",
            batch.id,
            len(batch.decode),
            sum(t.num_nodes for t in batch.trees.values()),
            len(batch.drafts),
            len(batch.prefill),
            batch.prefill_tokens,
            mean_context(batch.members),
            committed,
            draft_ms,
            verify_ms,
            wall_ms,
        )

    # ---- drafting --------------------------------------------------------------------------------
    async def _draft(self, batch: MicroBatch) -> tuple[Drafted, float, list[DraftTiming]]:
        """The trees the drafters answered in time (`DraftRound.apply`), the slowest replica's
        drafting time and each replica's, as it measured it. Fast switching's warm-ups
        (`batch.warm`) and the standby trees to merge go to the standby replicas in the same
        round: one DraftJob per replica."""
        drafts = DraftRound.of(self.core, batch)
        jobs = drafts.by_replica()
        if not jobs:
            return drafts.apply(self.core, {}), 0.0, []
        waits = {key: self._candidates.expect((batch.id, key[1])) for key in jobs}
        await self._publish(
            [
                (
                    draft_stream(self.cell, model, replica),
                    DraftJob(batch.id, tuple(job.entry for job in group)),
                )
                for (model, replica), group in jobs.items()
            ]
        )
        done, pending = await asyncio.wait(waits.values(), timeout=self.draft_timeout_s)
        self.stats.draft_timeouts += len(pending)
        answers: dict[DraftKey, DraftedTree] = {}
        draft_ms = 0.0
        timings: list[DraftTiming] = []
        calibrating = self.core.calibrating
        for (model, replica), wait in waits.items():
            if wait not in done or wait.cancelled():
                continue  # no answer in time: that drafter's state is unknown
            answer = wait.result()
            draft_ms = max(draft_ms, answer.draft_ms)
            if calibrating:
                timings += self._timing(model, jobs[model, replica], answer)
            for drafted in answer.entries:
                key = (model, replica, drafted.request_id)
                if key not in answers or answers[key].step != drafted.step:
                    answers[key] = self._rooted(drafted)  # the first of the step asked wins
        return drafts.apply(self.core, answers), draft_ms, timings

    @staticmethod
    def _timing(model: str, asked: Sequence[RoundJob], answer: CandidateTrees) -> list[DraftTiming]:
        """The replica's drafting as it measured it, with what each request appended and grew
        (`SchedulerCore.note_costs`); none where it grew nothing or did not measure."""
        appended = {job.entry.request_id: len(job.entry.new_tokens) for job in asked}
        grown = tuple(
            (appended[d.request_id], d.tree)
            for d in answer.entries
            if d.tree is not None and d.request_id in appended
        )
        if not grown or answer.draft_ms <= 0:
            return []
        return [DraftTiming(model, grown, answer.draft_ms)]

    def _rooted(self, drafted: DraftedTree) -> DraftedTree:
        """The answer, or an error where its tree grows from another token than the request's
        last committed one (a drafter out of step)."""
        request = self.core.requests.get(drafted.request_id)
        tree = drafted.tree
        if tree is None or (request is not None and tree.root_token == request.all_tokens[-1]):
            return drafted
        return DraftedTree(drafted.request_id, drafted.step, None, error="wrong_root")

    # ---- verification ----------------------------------------------------------------------------
    async def _verify(self, job: VerifyJob) -> VerifyResult:
        answer = self._results.expect(job.micro_batch_id)
        for attempt in range(VERIFY_ATTEMPTS):
            await self.bus.publish(verify_stream(self.cell), job)
            # the next hop is written: the candidate trees' entries may be acknowledged
            self._candidates.settle_where(lambda key: key[0] == job.micro_batch_id)
            try:
                async with asyncio.timeout(self.verify_timeout_s):
                    return await asyncio.shield(answer)
            except TimeoutError:
                self.stats.verify_resends += 1
                log.warning("micro-batch %d: no verify result, try %d", job.micro_batch_id, attempt)
        failed = tuple(
            VerifiedRequest(e.request_id, e.step, error="verify_timeout") for e in job.entries
        )
        return VerifyResult(job.micro_batch_id, 0.0, failed)

    # ---- committing ------------------------------------------------------------------------------
    def _outputs(
        self, outputs: list[StepOutput], requests: Mapping[str, RequestState] | None = None
    ) -> list[tuple[str, WireMessage]]:
        """Each output as its client sees it: Tokens, or a RequestError for a failure. A finished
        request found in `requests` gets its SLO statistics on its last Tokens."""
        messages: list[tuple[str, WireMessage]] = []
        for out in outputs:
            reply_to = self.reply_to.get(out.request_id)
            if reply_to is None:
                continue
            if out.error_type is not None:
                message = out.error or "request failed"
                messages.append((reply_to, RequestError(out.request_id, out.error_type, message)))
            elif out.new_tokens or out.finish_reason not in (None, "abort"):
                tokens = Tokens(
                    request_id=out.request_id,
                    step=out.step,
                    offset=out.offset,
                    token_ids=tuple(out.new_tokens),
                    finish=FINISH_REASONS.get(out.finish_reason or ""),
                    drafts=int(out.num_draft_tokens > 0),
                    draft_tokens=out.num_draft_tokens,
                    accepted_tokens=out.num_accepted,
                    draft_model=out.draft_model or "",
                    **_slo_statistics(out, (requests or {}).get(out.request_id)),
                    logprobs=out.logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                )
                messages.append((reply_to, tokens))
        return messages

    def _releases(self) -> list[tuple[str, WireMessage]]:
        """Release jobs for what the core let go: the verifier's KV, a drafter replica's state."""
        releases = ReleaseJobs(self)
        if route_releases(self.core, releases):
            self._notify()
        return releases.messages

    def _forget(self, request_id: str) -> None:
        """A request's target state is freed: once finished, it is stored and answered no more
        (its last output is already built)."""
        if request_id not in self.core.requests:
            self._remember(request_id)
            self.store.stage_finished(request_id)
            self.reply_to.pop(request_id, None)

    def _remember(self, request_id: str) -> None:
        self._finished[request_id] = None
        while len(self._finished) > REMEMBER_FINISHED:
            self._finished.popitem(last=False)

    def _observe_queue_times(self, batch: MicroBatch) -> None:
        """Each request's wait from its submit to its first micro-batch, counted once."""
        now = time.time()
        for request in batch.members:
            if request.first_token_time is None and request.request_id not in self._dequeued:
                self._dequeued[request.request_id] = None
                self._queue_times.observe(now - request.arrival_time)
        while len(self._dequeued) > REMEMBER_FINISHED:
            self._dequeued.popitem(last=False)

    async def _publish_stats(self) -> None:
        queued = self._queue_times.take()
        try:
            await publish_scheduler_stats(
                self.bus,
                self.cell,
                running=len(self.core.running),
                waiting=len(self.core.waiting),
                queued=queued,
                ttl_ms=self.bus.settings.heartbeat_ttl_ms,
            )
        except BaseException:
            self._queue_times.add(queued)  # counted at the next write
            raise

    async def _count_preemptions(self) -> None:
        """Add the core's preemptions since the last call to the cell's totals (best effort:
        what a Redis error kept back is added next time)."""
        delta = self.core.preemptions - self._counted_preemptions
        if not delta:
            return
        # claimed before the await: another lane counting meanwhile must not add it again
        self._counted_preemptions.update(delta)
        try:
            await add_preemptions(self.bus, self.cell, delta)
        except (RedisConnectionError, RedisTimeoutError, OSError) as error:
            self._counted_preemptions.subtract(delta)
            log.warning("could not count %d preemptions: %s", delta.total(), error)

    async def _publish(self, messages: list[tuple[str, WireMessage]]) -> None:
        """Write the next hop with the store's changes made since the last write (one
        transaction, in the order the core made them); committed tokens must not be lost, so
        Redis errors are retried."""
        staged = self.store.take_staged()  # before any await: what goes with these messages

        def store(pipe: Pipeline) -> None:
            self.store.write_staged(pipe, staged)

        delay = 0.05
        async with self._write_lock:
            while messages or staged:
                try:
                    await self.bus.publish_all(
                        messages,
                        also=store if staged else None,
                        slot_key=self.store.submits_key,
                    )
                    return
                except (RedisConnectionError, RedisTimeoutError, OSError) as error:
                    log.warning(
                        "publishing %d messages failed (%s); retrying", len(messages), error
                    )
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, PUBLISH_RETRY_MAX_S)
