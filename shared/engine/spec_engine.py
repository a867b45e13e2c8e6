"""The in-process speculative engine: one target, optionally one drafter, one loop.

This is the whole system in one process (no Redis), used by the CLI, the benchmarks and the
tests. The services split the same pieces (`Drafter`, `Verifier`) across processes; the loop
here is what the scheduler service runs. A step reads as three lines: schedule, run, finish.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from shared.engine.drafting import Drafter, DraftMethod, DraftRequest
from shared.engine.sampling import SEED_BITS, SamplingParams
from shared.engine.tree import TokenTree
from shared.engine.verifier import Verifier, VerifyEntry, VerifyResult
from shared.errors import ContextLengthError, InvalidRequestError, OutOfKVMemoryError
from shared.model.kv_cache import SwappedKV


class EngineConfig(BaseModel):
    max_prefill_tokens_per_step: int = Field(512, ge=1)
    max_running: int = Field(64, ge=1)


@dataclass
class AcceptanceStats:
    num_drafts: int = 0  # verify steps that offered at least one draft token
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_target_forwards: int = 0  # verify steps after prefill (each emits >= 1 token)

    def record(self, result: VerifyResult) -> None:
        self.num_target_forwards += 1
        if result.num_draft_tokens:
            self.num_drafts += 1
            self.num_draft_tokens += result.num_draft_tokens
            self.num_accepted += result.num_accepted
            grow = result.num_accepted - len(self.accepted_per_position)
            self.accepted_per_position.extend([0] * max(0, grow))
            for pos in range(result.num_accepted):
                self.accepted_per_position[pos] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        self.num_target_forwards += other.num_target_forwards
        grow = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, grow))
        for pos, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[pos] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward, bonus included (vLLM: 1 + accepted / drafts)."""
        if not self.num_target_forwards:
            return 0.0
        return 1.0 + self.num_accepted / self.num_target_forwards


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    output: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    num_seen_by_drafter: int = 0
    step: int = 0
    finish_reason: str | None = None
    error: str | None = None
    swapped: SwappedKV | None = None
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < len(self.prompt)

    @property
    def tokens_left(self) -> int:
        return self.params.max_tokens - len(self.output)


@dataclass
class StepOutput:
    request_id: str
    new_tokens: list[int]
    finish_reason: str | None
    error: str | None = None


@dataclass
class _Batch:
    prefill: list[tuple[Request, int]]  # request, chunk length
    decode: list[Request]
    failed: list[Request]  # could not go on (e.g. alone and still too big for the KV cache)


def tree_capacity(method: DraftMethod | None) -> int:
    """Most nodes (root included) a tree of this method can have."""
    if method is None:
        return 1
    match method.kind:
        case "chain":
            return 1 + method.k
        case "static":
            return 1 + sum(itertools.accumulate(method.expansion, lambda a, b: a * b))
        case "beam":
            return 1 + method.depth * method.width
        case _:
            return 1 + min(method.max_size, method.budget)


class SpecEngine:
    def __init__(
        self,
        verifier: Verifier,
        drafter: Drafter | None = None,
        method: DraftMethod | None = None,
        config: EngineConfig | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.method = method if drafter is not None else None
        self.config = config or EngineConfig()
        self.eos_token_ids = set(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = AcceptanceStats()
        self._ids = itertools.count()

    # ---- admission -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        runner = self.verifier.runner
        if not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        vocab = runner.cfg.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} out of range [0, {vocab})", param="prompt")
        if len(prompt) + params.max_tokens > runner.max_context:
            raise ContextLengthError(
                f"prompt of {len(prompt)} tokens plus max_tokens={params.max_tokens} exceeds "
                f"the model's context of {runner.max_context} tokens",
                param="max_tokens",
            )
        need = runner.cache.num_blocks_for(
            len(prompt) + params.max_tokens + tree_capacity(self.method)
        )
        if need > runner.cache.num_blocks:
            raise OutOfKVMemoryError(
                f"request needs {need} KV blocks, more than the cache's {runner.cache.num_blocks}"
            )
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        seed = params.seed if params.seed is not None else secrets.randbits(SEED_BITS)
        req = Request(rid, list(prompt), params, seed)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and req.finish_reason is None:
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self._schedule()
        results = self._run(batch)
        failed = [StepOutput(r.request_id, [], r.finish_reason, r.error) for r in batch.failed]
        return failed + self._postprocess(batch, results)

    def _schedule(self) -> _Batch:
        """Running requests decode; waiting ones are admitted (prefill chunks) while KV lasts."""
        runner = self.verifier.runner
        per_tree = tree_capacity(self.method)
        free = runner.cache.allocator.num_free
        decode: list[Request] = []
        failed: list[Request] = []
        for req in list(self.running):
            if req.is_prefilling or req not in self.running:  # (preempted for an older one)
                continue
            need = runner.blocks_needed(req.request_id, per_tree)
            while need > free:
                released = self._preempt_newest(exclude=req)
                if not released:
                    break
                free += released
            if need > free:
                if len(self.running) == 1:  # alone in the cache and still too big
                    self._finish(req, "error", "KV cache exhausted by a single request")
                    failed.append(req)
                else:  # older requests hold the memory: wait for them
                    free += self._preempt(req)
                continue
            free -= need
            decode.append(req)
        prefill: list[tuple[Request, int]] = []
        budget = self.config.max_prefill_tokens_per_step
        candidates = [r for r in self.running if r.is_prefilling] + list(self.waiting)
        for req in candidates:
            if budget <= 0:
                break
            if req.swapped is not None:
                blocks = runner.cache.num_blocks_for(req.swapped.num_tokens + per_tree)
                if blocks > free:
                    break
                runner.swap_in(req.request_id, req.swapped)
                free -= runner.cache.num_blocks_for(req.swapped.num_tokens)
                req.swapped = None
                self._admit(req)
                continue
            if req not in self.running and len(self.running) >= self.config.max_running:
                break
            chunk = min(budget, len(req.prompt) - req.num_prefilled)
            need = runner.blocks_needed(req.request_id, chunk)
            if need > free:
                break
            free -= need
            budget -= chunk
            self._admit(req)
            prefill.append((req, chunk))
        return _Batch(prefill, decode, failed)

    def _admit(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
            self.running.append(req)

    def _preempt_newest(self, exclude: Request) -> int:
        """Swap the most recently admitted other request out; returns the blocks released."""
        runner = self.verifier.runner
        for victim in reversed(self.running):
            if victim is exclude:
                return 0  # only requests admitted after `exclude` may be preempted for it
            if runner.has_request(victim.request_id):
                return self._preempt(victim)
        return 0

    def _preempt(self, victim: Request) -> int:
        """Swap a running request out (or drop its partial prefill); returns blocks released."""
        runner = self.verifier.runner
        released = len(runner.cache.blocks(victim.request_id))
        if victim.is_prefilling:
            runner.free_request(victim.request_id)
            victim.num_prefilled = 0
        else:
            victim.swapped = runner.swap_out(victim.request_id)
        if self.drafter is not None:
            self.drafter.free(victim.request_id)
            victim.num_seen_by_drafter = 0
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        return released

    def _run(self, batch: _Batch) -> list[VerifyResult]:
        trees = self._draft(batch.decode)
        entries = [
            VerifyEntry(
                req.request_id,
                req.step,
                req.params,
                req.seed,
                prompt_chunk=req.prompt[req.num_prefilled : req.num_prefilled + chunk],
                is_final_chunk=req.num_prefilled + chunk == len(req.prompt),
            )
            for req, chunk in batch.prefill
        ]
        entries += [
            VerifyEntry(req.request_id, req.step, req.params, req.seed, tree=trees[req.request_id])
            for req in batch.decode
        ]
        return self.verifier.step(entries) if entries else []

    def _draft(self, reqs: list[Request]) -> dict[str, TokenTree]:
        if self.drafter is None or self.method is None:
            return {r.request_id: TokenTree.root_only(r.output[-1]) for r in reqs}
        room = self.verifier.runner.max_context
        draft_reqs = [
            DraftRequest(
                r.request_id,
                r.all_tokens[r.num_seen_by_drafter :],
                r.params,
                r.seed,
                r.step,
                max_depth=min(r.tokens_left - 1, room - len(r.all_tokens)),
            )
            for r in reqs
        ]
        trees = self.drafter.draft(draft_reqs, self.method)
        for r in reqs:
            r.num_seen_by_drafter = len(r.all_tokens)
        return trees

    def _postprocess(self, batch: _Batch, results: list[VerifyResult]) -> list[StepOutput]:
        chunks = {req.request_id: chunk for req, chunk in batch.prefill}
        outputs = []
        for res in results:
            req = self.requests[res.request_id]
            req.step += 1
            if res.request_id in chunks:
                req.num_prefilled += chunks[res.request_id]
            else:
                req.stats.record(res)
                self.stats.record(res)
            new_tokens = self._append(req, res.tokens)
            if new_tokens or req.finish_reason:
                outputs.append(StepOutput(req.request_id, new_tokens, req.finish_reason))
        return outputs

    def _append(self, req: Request, tokens: list[int]) -> list[int]:
        appended = []
        stops = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stops |= self.eos_token_ids
        for tok in tokens:
            if tok in stops:
                self._finish(req, "stop")
                break
            req.output.append(tok)
            appended.append(tok)
            if req.tokens_left == 0:
                self._finish(req, "length")
                break
        return appended

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason = reason
        req.error = error
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.verifier.free(req.request_id)
        if self.drafter is not None:
            self.drafter.free(req.request_id)

    # ---- conveniences -------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Request]:
        """Run prompts to completion together (continuous batching); requests in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_unfinished():
            self.step()
        return [self.requests.pop(i) for i in ids]

    def stream(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[list[int]]:
        """Yield each step's new tokens of one request as they are committed."""
        rid = self.add_request(prompt, params)
        while self.requests[rid].finish_reason is None:
            for out in self.step():
                if out.request_id == rid and out.new_tokens:
                    yield out.new_tokens
        self.requests.pop(rid)
