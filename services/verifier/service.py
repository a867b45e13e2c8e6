"""The verifier: reads VerifyJobs, runs one packed forward of prompt chunks and token trees,
accepts, compacts the KV, and answers a VerifyResult.

Per request it keeps the target KV (the engine's `Verifier` state) and its last answer, keyed by
step, so a redelivered job replays answers instead of running the model twice. Entries it cannot
run get an error and commit nothing:
- `out_of_sync`: a tree for a request it holds no KV for (it restarted) or whose root is not
  where its KV ends (a stale job moved it), or a chunk that does not start where its KV ends;
  chunk_start 0 always restarts the request;
- `out_of_kv_memory`: the entry does not fit in the free KV blocks (the scheduler recomputes it
  later); entries are admitted in job order, so the scheduler's order decides who waits;
- `verify_failed`: the forward raised; the batch's requests are dropped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.model_service import ModelService
from shared.bus import Bus
from shared.engine.verifier import Verifier
from shared.model.runner import ModelRunner
from shared.wire import VerifiedRequest, VerifyJob, VerifyRequest, VerifyResult
from shared.wire.streams import VERIFIER, results_stream, verify_stream

log = logging.getLogger(__name__)

OUT_OF_SYNC = "out_of_sync"
OUT_OF_KV_MEMORY = "out_of_kv_memory"
VERIFY_FAILED = "verify_failed"


@dataclass
class VerifierStats:
    jobs: int = 0
    entries: int = 0
    replayed: int = 0
    errors: int = 0
    verify_ms: float = 0.0


class VerifierService(ModelService[VerifyJob, VerifyResult]):
    job_type = VerifyJob

    def __init__(self, bus: Bus, runner: ModelRunner, *, cell: str, model: str = "target") -> None:
        super().__init__(
            bus,
            service=VERIFIER,
            cell=cell,
            model=model,
            job_stream=verify_stream(cell),
            reply_stream=results_stream(cell),
        )
        self.verifier = Verifier(runner)
        self.stats = VerifierStats()
        self._answers: dict[str, VerifiedRequest] = {}

    @property
    def runner(self) -> ModelRunner:
        return self.verifier.runner

    verify_job = ModelService.run_job

    # ---- on the model thread ---------------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        self.verifier.free(request_id)
        self._answers.pop(request_id, None)

    def answer(self, job: VerifyJob) -> VerifyResult:
        started = time.perf_counter()
        answers: dict[int, VerifiedRequest] = {}
        todo: dict[int, VerifyRequest] = {}
        free_blocks = self.runner.cache.allocator.num_free
        seen: set[str] = set()
        for i, entry in enumerate(job.entries):
            replay = self._answers.get(entry.request_id)
            if replay is not None and replay.step == entry.step:
                answers[i] = replay
                self.stats.replayed += 1
                continue
            problem = self._check(entry, seen)
            if problem is None:
                need = self.runner.blocks_needed(entry.request_id, self._num_tokens(entry))
                if need > free_blocks:
                    problem = f"{OUT_OF_KV_MEMORY}: needs {need} blocks, {free_blocks} free"
                else:
                    free_blocks -= need
            seen.add(entry.request_id)
            if problem is None:
                todo[i] = entry
            else:
                answers[i] = self._error(entry, problem)
        answers.update(self._run(todo))
        for answer in answers.values():
            if answer.error is None:
                self._answers[answer.request_id] = answer
        verify_ms = 1000 * (time.perf_counter() - started)
        self.stats.jobs += 1
        self.stats.entries += len(job.entries)
        self.stats.verify_ms += verify_ms
        entries = tuple(answers[i] for i in range(len(job.entries)))
        return VerifyResult(micro_batch_id=job.micro_batch_id, verify_ms=verify_ms, entries=entries)

    @staticmethod
    def _num_tokens(entry: VerifyRequest) -> int:
        return len(entry.chunk) if entry.tree is None else entry.tree.num_nodes

    def _check(self, entry: VerifyRequest, seen: set[str]) -> str | None:
        rid = entry.request_id
        if rid in seen:
            return "invalid_job: the request appears twice in one job"
        runner = self.runner
        vocab = runner.cfg.vocab_size
        tokens = entry.chunk if entry.tree is None else entry.tree.tokens.tolist()
        if any(not 0 <= t < vocab for t in tokens):
            return "invalid_tokens: a token id is outside the target's vocabulary"
        have = runner.num_cached(rid) if runner.has_request(rid) else None
        if entry.tree is not None:
            if have is None:
                return f"{OUT_OF_SYNC}: no KV for this request"
            if entry.context_len is not None and have != entry.context_len:
                return (
                    f"{OUT_OF_SYNC}: holds {have} tokens, the tree's root is at {entry.context_len}"
                )
            if have + int(entry.tree.depths().max()) >= runner.max_context:
                return "context_length_exceeded: the tree runs past the model's context"
            return None
        if entry.chunk_start == 0 and have:
            self.verifier.free(rid)  # the scheduler recomputes this request from its start
            have = 0
        if entry.chunk_start != (have or 0):
            return f"{OUT_OF_SYNC}: holds {have or 0} tokens, chunk starts at {entry.chunk_start}"
        if entry.chunk_start + len(entry.chunk) > runner.max_context:
            return "context_length_exceeded: the chunk runs past the model's context"
        return None

    def _error(self, entry: VerifyRequest, reason: str) -> VerifiedRequest:
        self.stats.errors += 1
        return VerifiedRequest(entry.request_id, entry.step, error=reason[:200])

    def _run(self, todo: dict[int, VerifyRequest]) -> dict[int, VerifiedRequest]:
        if not todo:
            return {}
        entries = list(todo.values())
        try:
            results = self.verifier.step(entries)
        except Exception as error:
            log.exception("verify step of %d entries failed", len(entries))
            for e in todo.values():
                self.verifier.free(e.request_id)
            return {i: self._error(e, f"{VERIFY_FAILED}: {error!r}") for i, e in todo.items()}
        return dict(zip(todo, results, strict=True))
