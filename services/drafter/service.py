"""A drafter replica: reads DraftJobs from its own stream, answers CandidateTrees.

Per request it keeps the draft KV of every committed token (the engine's `Drafter` state) and
the last answer it gave, keyed by step: a redelivered job for a step already drafted gets the
same trees again without touching the model. A job whose `base_len` does not match what this
replica holds gets `out_of_sync` for that request (`base_len` 0 always restarts the request).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from services.model_service import ModelService
from shared.bus import Bus
from shared.engine.drafting import Drafter
from shared.model.runner import ModelRunner
from shared.values.methods import DraftMethod, tree_capacity
from shared.wire import CandidateTrees, DraftedTree, DraftJob, DraftRequest
from shared.wire.streams import DRAFTER, candidates_stream, draft_stream

log = logging.getLogger(__name__)

OUT_OF_SYNC = "out_of_sync"
OUT_OF_KV_MEMORY = "out_of_kv_memory"


@dataclass
class DrafterStats:
    jobs: int = 0
    requests: int = 0
    replayed: int = 0
    draft_ms: float = 0.0
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class DrafterService(ModelService[DraftJob, CandidateTrees]):
    job_type = DraftJob

    def __init__(self, bus: Bus, runner: ModelRunner, *, model: str, cell: str) -> None:
        self.replica = bus.consumer_name
        super().__init__(
            bus,
            service=DRAFTER,
            cell=cell,
            model=model,
            job_stream=draft_stream(cell, model, bus.consumer_name),
            reply_stream=candidates_stream(cell),
        )
        self.drafter = Drafter(runner, name=model)
        self.stats = DrafterStats()
        self._answers: dict[str, DraftedTree] = {}  # last answer per request, for redeliveries

    @property
    def runner(self) -> ModelRunner:
        return self.drafter.runner

    draft_job = ModelService.run_job

    def forget(self, request_id: str) -> None:
        self.drafter.release(request_id)
        self._answers.pop(request_id, None)

    def answer(self, job: DraftJob) -> CandidateTrees:
        """One batched draft of the job's requests (replaying answers already given)."""
        started = time.perf_counter()
        answers: dict[int, DraftedTree] = {}
        todo: dict[int, DraftRequest] = {}
        for i, entry in enumerate(job.entries):
            replay = self._answers.get(entry.request_id)
            if replay is not None and replay.step == entry.step:
                answers[i] = replay
                self.stats.replayed += 1
                continue
            problem = self._sync(entry)
            if problem is not None:
                answers[i] = self._error(entry, problem)
            else:
                todo[i] = entry
        answers.update(self._draft(todo))
        for answer in answers.values():
            self._answers[answer.request_id] = answer
        draft_ms = 1000 * (time.perf_counter() - started)
        self.stats.jobs += 1
        self.stats.requests += len(job.entries)
        self.stats.draft_ms += draft_ms
        return CandidateTrees(
            micro_batch_id=job.micro_batch_id,
            model=self.model,
            replica=self.replica,
            draft_ms=draft_ms,
            entries=tuple(answers[i] for i in range(len(job.entries))),
        )

    def _sync(self, entry: DraftRequest) -> str | None:
        runner = self.runner
        have = self.drafter.num_committed(entry.request_id)
        if entry.base_len == 0 and runner.has_request(entry.request_id):
            self.drafter.free(entry.request_id)  # the scheduler restarts this request here
            have = 0
        if have != entry.base_len:
            return f"{OUT_OF_SYNC}: holds {have} tokens, job says {entry.base_len}"
        if not entry.new_tokens:
            return f"{OUT_OF_SYNC}: no new tokens to root a tree at"
        vocab = runner.cfg.vocab_size
        if any(not 0 <= t < vocab for t in entry.new_tokens):
            return "invalid_tokens: a token id is outside the draft model's vocabulary"
        return self.drafter.feature_problem(entry)

    def _error(self, entry: DraftRequest, reason: str) -> DraftedTree:
        self.stats.errors[reason.split(":")[0]] += 1
        return DraftedTree(entry.request_id, entry.step, None, reason)

    def _fit_in_memory(
        self,
        todo: dict[int, DraftRequest],
        indices: list[int],
        method: DraftMethod,
        answers: dict[int, DraftedTree],
    ) -> list[int]:
        """Entries whose delta and tree fit in the free draft KV, in job order; the others get
        `out_of_kv_memory` (no tree this step, and their draft state restarts later)."""
        free = self.runner.cache.allocator.num_free
        nodes = tree_capacity(method)
        fitting = []
        for i in indices:
            entry = todo[i]
            need = self.runner.blocks_needed(entry.request_id, len(entry.new_tokens) + nodes)
            if need > free:
                self.drafter.free(entry.request_id)
                answers[i] = self._error(entry, f"{OUT_OF_KV_MEMORY}: needs {need} blocks")
            else:
                free -= need
                fitting.append(i)
        return fitting

    def _draft(self, todo: dict[int, DraftRequest]) -> dict[int, DraftedTree]:
        """One batched draft per method (a job normally carries one)."""
        groups: dict[DraftMethod, list[int]] = defaultdict(list)
        for i, entry in todo.items():
            groups[entry.method].append(i)
        answers: dict[int, DraftedTree] = {}
        for method, indices in groups.items():
            indices = self._fit_in_memory(todo, indices, method, answers)
            if not indices:
                continue
            entries = [todo[i] for i in indices]
            try:
                trees = self.drafter.draft(entries, method.for_batch(len(entries)))
            except Exception as error:  # e.g. out of draft KV: these requests restart from 0
                log.warning(
                    "drafter %s failed on %d requests: %r", self.replica, len(entries), error
                )
                for i, e in zip(indices, entries, strict=True):
                    self.drafter.free(e.request_id)
                    answers[i] = self._error(e, f"draft_failed: {error!r}"[:200])
                continue
            for i, e in zip(indices, entries, strict=True):
                answers[i] = DraftedTree(e.request_id, e.step, trees[e.request_id])
        return answers
