"""The scheduler: the request pool and the iteration loop (DESIGN §2), over Redis only.

M lanes run the loop at once, each carrying one micro-batch at a time through its stages
(Spin §V-B): while one micro-batch is being verified, drafters speculate another. One lane's
iteration:

1. form a micro-batch from idle requests (policy order, token budget, admissions);
2. send one DraftJob per drafter replica (deltas of committed tokens), await CandidateTrees;
3. select each request's tree under the budget; send one VerifyJob, await its VerifyResult;
4. commit tokens, apply stops, append Tokens to each request's output stream, release what
   finished.

Every answer is matched by (micro-batch, request, step): a stale or repeated answer changes
nothing. The scheduler touches token ids and counters only, never tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.scheduler.batching import BatchLimits, MicroBatch, form_batch, tree_nodes
from services.scheduler.drafters import DrafterDirectory, FixedDraftModel
from services.scheduler.policy import make_policy
from services.scheduler.replies import Replies
from services.scheduler.request import FINISH_REASONS, PoolRequest, append_tokens
from services.scheduler.selection import make_selector, root_only
from shared.bus import Bus, DeadLetterError, Delivery, Heartbeater, StreamConsumer
from shared.engine.sampling import SEED_BITS
from shared.engine.spec_engine import AcceptanceStats
from shared.engine.tree import TokenTree
from shared.engine.verifier import VerifyResult as EngineResult
from shared.settings import AugurySettings, SpeculationSettings
from shared.wire import (
    BeamMethod,
    Cancel,
    CandidateTrees,
    ChainMethod,
    DraftJob,
    DraftMethod,
    DraftRequest,
    DynamicTreeMethod,
    RequestError,
    StaticTreeMethod,
    Submit,
    Tokens,
    VerifiedRequest,
    VerifyJob,
    VerifyRequest,
    VerifyResult,
    WireMessage,
)
from shared.wire.streams import (
    SCHEDULER,
    candidates_stream,
    draft_stream,
    requests_stream,
    results_stream,
    verify_stream,
)

log = logging.getLogger(__name__)

RELEASE_ONLY = 0  # micro-batch id of jobs that only release state (nobody waits for an answer)
DRAFT_TIMEOUT_S = 10.0  # then the step goes on without that replica's trees
VERIFY_TIMEOUT_S = 60.0  # then the VerifyJob is sent again (the verifier replays by step)
VERIFY_ATTEMPTS = 3
REMEMBER_FINISHED = 10_000  # request ids kept to recognise a redelivered Submit
IDLE_POLL_S = 1.0
STOP_POLL_S = 1.0
PUBLISH_RETRY_MAX_S = 2.0


@dataclass(frozen=True)
class TargetInfo:
    """What the scheduler knows about the target: limits, not weights."""

    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerStats:
    iterations: int = 0
    wall_ms: float = 0.0  # whole iterations, summed
    draft_ms: float = 0.0  # drafting as the drafters measured it (slowest replica per step)
    verify_ms: float = 0.0  # verification as the verifier measured it
    draft_timeouts: int = 0
    verify_resends: int = 0
    preempted: int = 0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)

    @property
    def hop_ms_per_iteration(self) -> float:
        """Per-iteration time outside the models: Redis hops, (de)serialization, scheduling."""
        if not self.iterations:
            return 0.0
        return (self.wall_ms - self.draft_ms - self.verify_ms) / self.iterations


def wire_method(spec: SpeculationSettings) -> DraftMethod | None:
    match spec.method:
        case "chain":
            return ChainMethod(spec.chain_length)
        case "static":
            return StaticTreeMethod(tuple(spec.static_expansion))
        case "beam":
            return BeamMethod(spec.beam_depth, spec.beam_width)
        case "dynamic":
            return DynamicTreeMethod(
                spec.dynamic_max_nodes, spec.dynamic_max_depth, spec.dynamic_max_width
            )
    return None


class SchedulerService:
    def __init__(
        self,
        settings: AugurySettings,
        bus: Bus,
        target: TargetInfo,
        *,
        draft_models: Sequence[str] = (),
        draft_timeout_s: float = DRAFT_TIMEOUT_S,
        verify_timeout_s: float = VERIFY_TIMEOUT_S,
    ) -> None:
        config = settings.scheduler
        self.bus = bus
        self.cell = settings.service.cell
        self.target = target
        self.method = wire_method(config.speculation)
        self.limits = BatchLimits(
            token_budget=settings.engine.max_tokens_per_step,
            max_running=config.max_running_requests,
            micro_batches=config.micro_batches,
            tree_nodes=tree_nodes(self.method),
        )
        self.policy = make_policy(config.policy)
        self.selector = make_selector(config.tree_selection)
        self.drafters = DrafterDirectory(bus, self.cell, FixedDraftModel(draft_models))
        self.draft_timeout_s = draft_timeout_s
        self.verify_timeout_s = verify_timeout_s
        self.requests: dict[str, PoolRequest] = {}
        self.running: list[PoolRequest] = []
        self.waiting: list[PoolRequest] = []
        self.stats = SchedulerStats()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._arrivals = itertools.count()
        self._batch_ids = itertools.count(secrets.randbits(40) + 1)
        self._kv_full = False  # the verifier refused KV: admit nobody until a request finishes
        self._wake = asyncio.Event()
        self._candidates: Replies[CandidateTrees] = Replies()
        self._results: Replies[VerifyResult] = Replies()
        self._lanes: list[asyncio.Task[None]] = []
        concurrency = 64 * config.micro_batches
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
            in_flight=lambda: len(self.running),
        )

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.drafters.start()
        for consumer in self.consumers:
            await consumer.start()
        self._lanes = [
            asyncio.create_task(self._lane(), name=f"scheduler-lane-{i}")
            for i in range(self.limits.micro_batches)
        ]
        await self.heartbeat.start()

    async def stop(self) -> None:
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

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    # ---- the request stream ----------------------------------------------------------------
    async def handle_request(self, delivery: Delivery) -> None:
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
        if rid in self.requests or rid in self._finished:
            return  # a redelivered Submit
        problem = self._check(submit)
        if problem is not None:
            self._remember(rid)
            await self.bus.publish(submit.reply_to, problem)
            return
        seed = submit.sampling.seed
        seed = seed if seed is not None else secrets.randbits(SEED_BITS)
        request = PoolRequest.from_submit(submit, seed, next(self._arrivals))
        self.requests[rid] = request
        self.waiting.append(request)
        self._notify()

    def _check(self, submit: Submit) -> RequestError | None:
        rid = submit.request_id
        bad = next((t for t in submit.prompt if not 0 <= t < self.target.vocab_size), None)
        if bad is not None:
            message = f"token id {bad} out of range [0, {self.target.vocab_size})"
            return RequestError(rid, "invalid_request", message, "prompt")
        total = len(submit.prompt) + submit.sampling.max_tokens
        if total > self.target.max_context:
            message = (
                f"prompt ({len(submit.prompt)} tokens) plus max_tokens "
                f"({submit.sampling.max_tokens}) exceeds the context of "
                f"{self.target.max_context} tokens"
            )
            return RequestError(rid, "context_length_exceeded", message, "max_tokens")
        return None

    def cancel(self, request_id: str) -> list[tuple[str, WireMessage]]:
        """Stop a request; free its state now, or when its micro-batch comes back."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        request.cancelled = True
        if request.in_flight:
            return []
        return self._finish(request, "abort")

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
            batch = self._next_batch()
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
                for request in batch.members:
                    request.in_flight = False
                self._notify()

    def _next_batch(self) -> MicroBatch | None:
        running = self.policy.order(self.running)
        waiting = self.policy.order(self.waiting)
        admit = not self._kv_full or not self.running
        batch, admitted = form_batch(next(self._batch_ids), running, waiting, self.limits, admit)
        for request in admitted:
            self.waiting.remove(request)
            self.running.append(request)
        if not batch.members:
            return None
        for request in batch.members:
            request.in_flight = True
        return batch

    async def _iterate(self, batch: MicroBatch) -> None:
        started = time.perf_counter()
        try:
            trees, draft_ms = await self._draft(batch)
            job = VerifyJob(batch.id, self._verify_entries(batch, trees))
            result = await self._verify(job)
            await self._publish(self._commit(batch, trees, result))
        finally:  # whatever happened, let the answers' entries be acknowledged
            self._candidates.settle_where(lambda key: key[0] == batch.id)
            self._results.settle(batch.id)
        self.stats.iterations += 1
        self.stats.wall_ms += 1000 * (time.perf_counter() - started)
        self.stats.draft_ms += draft_ms
        self.stats.verify_ms += result.verify_ms

    # ---- drafting --------------------------------------------------------------------------------
    async def _draft(self, batch: MicroBatch) -> tuple[dict[str, TokenTree], float]:
        """Candidate trees of the decoding requests (root only where nobody drafts), selected
        under the budget, and the drafting time the slowest replica reported."""
        trees = {r.request_id: root_only(r.all_tokens) for r in batch.decode}
        jobs: dict[tuple[str, str], list[DraftRequest]] = {}
        for request in batch.decode:
            entry = self._draft_request(request)
            if entry is not None:
                assert request.draft_model is not None and request.drafter is not None
                jobs.setdefault((request.draft_model, request.drafter), []).append(entry)
        releases = self._left_behind()
        waits = [self._candidates.expect((batch.id, replica)) for _, replica in jobs]
        messages = [
            (draft_stream(self.cell, model, replica), DraftJob(batch.id, tuple(entries)))
            for (model, replica), entries in jobs.items()
        ]
        draft_ms = 0.0
        await self._publish(messages + releases)
        if waits:
            done, pending = await asyncio.wait(waits, timeout=self.draft_timeout_s)
            self.stats.draft_timeouts += len(pending)
            sent = {e.request_id: e for entries in jobs.values() for e in entries}
            for answer in (w.result() for w in done if not w.cancelled()):
                draft_ms = max(draft_ms, answer.draft_ms)
                self._take_trees(answer, sent, trees)
            for entry in sent.values():  # no answer in time: that drafter's state is unknown
                self.requests[entry.request_id].num_seen_by_drafter = 0
        budget = self.limits.token_budget - batch.prefill_tokens
        depth = {r.request_id: self._max_depth(r) for r in batch.decode}
        return self.selector.select(trees, budget, depth), draft_ms

    def _draft_request(self, request: PoolRequest) -> DraftRequest | None:
        if self.method is None or not request.speculate or request.tokens_left <= 1:
            return None
        if not self.drafters.assign(request):
            return None
        tokens = request.all_tokens
        base = request.num_seen_by_drafter
        if base >= len(tokens):  # nothing new to root a tree at: start that drafter over
            base = 0
        return DraftRequest(
            request_id=request.request_id,
            step=request.step,
            base_len=base,
            new_tokens=tuple(tokens[base:]),
            method=self.method,
            sampling=request.params,
            seed=request.seed,
        )

    def _take_trees(
        self,
        answer: CandidateTrees,
        sent: dict[str, DraftRequest],
        trees: dict[str, TokenTree],
    ) -> None:
        for drafted in answer.entries:
            entry = sent.get(drafted.request_id)
            if entry is None or entry.step != drafted.step:
                continue
            del sent[drafted.request_id]
            request = self.requests[drafted.request_id]
            tokens = request.all_tokens
            if drafted.tree is None or drafted.tree.root_token != tokens[-1]:
                request.num_seen_by_drafter = 0  # resend from the first token next time
                continue
            request.num_seen_by_drafter = len(tokens)
            trees[request.request_id] = drafted.tree

    def _max_depth(self, request: PoolRequest) -> int:
        room = self.target.max_context - len(request.all_tokens)
        return max(0, min(request.tokens_left - 1, room))

    def _left_behind(self) -> list[tuple[str, WireMessage]]:
        moved, self.drafters.left_behind = self.drafters.left_behind, []
        return [
            (draft_stream(self.cell, model, replica), DraftJob(RELEASE_ONLY, (), (rid,)))
            for model, replica, rid in moved
        ]

    # ---- verification ----------------------------------------------------------------------------
    def _verify_entries(
        self, batch: MicroBatch, trees: dict[str, TokenTree]
    ) -> tuple[VerifyRequest, ...]:
        entries = [
            VerifyRequest(
                request_id=r.request_id,
                step=r.step,
                sampling=r.params,
                seed=r.seed,
                max_new_tokens=r.tokens_left,
                tree=trees[r.request_id],
            )
            for r in batch.decode
        ]
        for r, chunk in batch.prefill:
            start = r.num_prefilled
            entries.append(
                VerifyRequest(
                    request_id=r.request_id,
                    step=r.step,
                    sampling=r.params,
                    seed=r.seed,
                    max_new_tokens=r.tokens_left,
                    chunk=tuple(r.prefill_tokens[start : start + chunk]),
                    chunk_start=start,
                    chunk_is_last=start + chunk == len(r.prefill_tokens),
                )
            )
        return tuple(entries)

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
    def _commit(
        self, batch: MicroBatch, trees: dict[str, TokenTree], result: VerifyResult
    ) -> list[tuple[str, WireMessage]]:
        answers = {e.request_id: e for e in result.entries}
        chunks = {r.request_id: n for r, n in batch.prefill}
        out: list[tuple[str, WireMessage]] = []
        for request in batch.members:
            if request.cancelled:
                out += self._finish(request, "abort")
                continue
            answer = answers.get(request.request_id)
            if answer is None or answer.step != request.step:
                answer = VerifiedRequest(request.request_id, request.step, error="out_of_sync")
            if answer.error is not None:
                out += self._failed(request, answer.error)
                continue
            request.step += 1
            drafted = 0
            if request.request_id in chunks:
                request.num_prefilled += chunks[request.request_id]
            else:
                drafted = trees[request.request_id].num_nodes - 1
                record = EngineResult(
                    request.request_id,
                    answer.step,
                    list(answer.new_tokens),
                    drafted,
                    len(answer.accepted),
                )
                request.stats.record(record)
                self.stats.acceptance.record(record)
            new = append_tokens(request, answer.new_tokens, self.target.eos_token_ids)
            if new or request.is_finished:
                finish = FINISH_REASONS.get(request.finish_reason or "")
                tokens = Tokens(
                    request_id=request.request_id,
                    step=answer.step,
                    offset=len(request.output) - len(new),
                    token_ids=tuple(new),
                    finish=finish,
                    drafts=int(drafted > 0),
                    draft_tokens=drafted,
                    accepted_tokens=len(answer.accepted) if drafted else 0,
                )
                out.append((request.reply_to, tokens))
            if request.is_finished:
                out += self._finish(request, request.finish_reason or "stop")
        return out

    def _failed(self, request: PoolRequest, error: str) -> list[tuple[str, WireMessage]]:
        """Out of KV or out of sync: recompute later. Anything else fails the request."""
        kind = error.split(":")[0]
        if kind == "out_of_kv_memory" and self.running == [request]:
            message = "the request needs more KV memory than the verifier has, even alone"
            refusal = RequestError(request.request_id, "context_length_exceeded", message)
            return [(request.reply_to, refusal), *self._finish(request, "abort")]
        if kind in ("out_of_kv_memory", "out_of_sync", "verify_timeout"):
            self._kv_full |= kind == "out_of_kv_memory"
            self.stats.preempted += 1
            request.recompute()
            self.running.remove(request)
            self.waiting.insert(0, request)
            return [(verify_stream(self.cell), VerifyJob(RELEASE_ONLY, (), (request.request_id,)))]
        log.warning("request %s failed: %s", request.request_id, error)
        message = RequestError(request.request_id, "internal_error", f"verification failed: {kind}")
        return [(request.reply_to, message), *self._finish(request, "abort")]

    def _finish(self, request: PoolRequest, reason: str) -> list[tuple[str, WireMessage]]:
        """Drop the request from the pool; release its KV in the verifier and its drafter."""
        request.finish_reason = reason
        rid = request.request_id
        self.requests.pop(rid, None)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._remember(rid)
        self._kv_full = False
        self._notify()
        out: list[tuple[str, WireMessage]] = [
            (verify_stream(self.cell), VerifyJob(RELEASE_ONLY, (), (rid,)))
        ]
        if request.draft_model is not None and request.drafter is not None:
            self.drafters.release(request)
            stream = draft_stream(self.cell, request.draft_model, request.drafter)
            out.append((stream, DraftJob(RELEASE_ONLY, (), (rid,))))
        return out

    def _remember(self, request_id: str) -> None:
        self._finished[request_id] = None
        while len(self._finished) > REMEMBER_FINISHED:
            self._finished.popitem(last=False)

    async def _publish(self, messages: list[tuple[str, WireMessage]]) -> None:
        """Write the next hop; committed tokens must not be lost, so Redis errors are retried."""
        delay = 0.05
        while messages:
            try:
                await self.bus.publish_all(messages)
                return
            except (RedisConnectionError, RedisTimeoutError, OSError) as error:
                log.warning("publishing %d messages failed (%s); retrying", len(messages), error)
                await asyncio.sleep(delay)
                delay = min(2 * delay, PUBLISH_RETRY_MAX_S)
