"""Admission: which requests a micro-batch takes, decoding and prompt chunks, under the token
budget and the verifier's KV memory, and preemption (kept, swapped or recomputed) when that
memory runs short. The KV view counts blocks; no tensors are touched here."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from shared.scheduling.core_types import KVView, MicroBatch, mean_context
from shared.scheduling.cost_model import TYPICAL_CONTEXT
from shared.scheduling.micro_batches import choose_micro_batches, is_shared_device
from shared.scheduling.ordering import PolicyContext
from shared.scheduling.pool import RequestPool
from shared.scheduling.request import RequestState
from shared.values.methods import tree_capacity


@dataclass
class Intake:
    """One micro-batch's admission: the idle requests in the policy's order, and what is left."""

    ctx: PolicyContext
    kv: KVView | None
    num_micro_batches: int
    running: list[RequestState]  # idle running requests, in the policy's order
    waiting: list[RequestState]  # in the policy's order
    admit: bool  # whether new requests may be admitted
    share: int  # most requests the micro-batch takes
    free: int  # KV blocks still free (0 without a KV view)


class Admission:
    def __init__(self, pool: RequestPool) -> None:
        self.pool = pool
        self._micro_batch_choice: dict[tuple[int, int, int, int], int] = {}

    # ---- micro-batches -------------------------------------------------------------------------
    def num_micro_batches(self, num_requests: int) -> int:
        """How many micro-batches to keep in flight for a running set of `num_requests`."""
        pool, config = self.pool, self.pool.config
        if not config.auto_micro_batches or pool.cost is None or config.method is None:
            return config.micro_batches
        nodes, depth = pool.step_shape.typical(
            tree_capacity(config.method), config.method.num_layers
        )
        key = (num_requests, nodes, depth, id(pool.cost))
        chosen = self._micro_batch_choice.get(key)
        if chosen is None:
            chosen = choose_micro_batches(
                pool.cost,
                self._slowest_draft(),
                num_requests,
                nodes,
                depth,
                mean_context(pool.running) or TYPICAL_CONTEXT,
                max_micro_batches=config.micro_batches,
                max_drop=config.micro_batch_drop,
                shared_device=is_shared_device(pool.cost),
            )
            self._micro_batch_choice = {key: chosen}  # re-chosen when the set changes size
        return chosen

    def _slowest_draft(self) -> str | None:
        """The live draft model whose forward costs most: a step's drafting waits for it."""
        cost = self.pool.cost
        assert cost is not None
        priced = [m for m in self.pool.drafters if cost.has_draft(m)]
        return max(priced, key=cost.draft_cost_per_token_ms, default=None)

    # ---- a micro-batch's admission -------------------------------------------------------------
    def start(
        self, batch: MicroBatch, now: float, kv: KVView | None, num_micro_batches: int
    ) -> Intake:
        """Apply the policy's preemptions, resume kept requests, and order who may run."""
        pool = self.pool
        ctx = PolicyContext(now, pool.cost, pool.config.max_running)
        idle = [r for r in pool.running if not r.in_flight]
        # a request the policy preempts keeps its KV in the cache (it resumes at no cost);
        # memory pressure moves a kept request's KV out later (`_evict_kept`)
        for victim in pool.policy.preempt(idle, pool.waiting, ctx):
            self.preempt(victim, batch, kv, keep=True)
        self._resume_kept(ctx)
        running = pool.policy.order([r for r in pool.running if not r.in_flight], ctx)
        waiting = pool.policy.order(pool.waiting, ctx)
        admit = not pool.kv_full or not pool.running
        active = len(pool.running) + (len(waiting) if admit else 0)
        share = max(1, math.ceil(active / num_micro_batches))
        free = kv.num_free_blocks() if kv is not None else 0
        return Intake(ctx, kv, num_micro_batches, running, waiting, admit, share, free)

    def take_decoding(self, batch: MicroBatch, intake: Intake) -> None:
        """The micro-batch's decoding requests, each with KV for its largest tree."""
        pool, kv = self.pool, intake.kv
        decoding = [r for r in intake.running if not r.is_prefilling]
        limit = min(intake.share, pool.config.token_budget)
        for request in self._pick_decoding(decoding, limit, intake.num_micro_batches):
            if request not in pool.running:  # preempted for an older one
                continue
            if kv is not None:
                need = kv.blocks_needed(request.request_id, pool.tree_capacity(request))
                if not self._make_room(request, need, batch, intake, may_preempt=True):
                    if len(pool.running) == 1:  # alone in the cache and still too big
                        message = "KV cache exhausted by a single request"
                        batch.failed.append(pool.finished_output(request, "error", message))
                    else:  # older requests hold the memory: wait for them
                        intake.free += self.preempt(request, batch, kv)
                    continue
            batch.decode.append(request)

    def take_prompts(self, batch: MicroBatch, intake: Intake) -> None:
        """Prompt chunks (and resumed requests) in the budget that speculation leaves: a
        decoding request reserves its root and about a node per planned level."""
        pool, budget = self.pool, self.pool.config.token_budget
        reserve = sum(
            1 + (batch.drafts[r.request_id].max_depth if r.request_id in batch.drafts else 0)
            for r in batch.decode
        )
        if any(r.is_prefilling for r in intake.running) or (intake.admit and intake.waiting):
            reserve = min(reserve, budget // 2)
        room = budget - max(reserve, len(batch.decode))
        count = len(batch.decode)
        candidates = [r for r in intake.running if r.is_prefilling and r in pool.running]
        candidates += intake.waiting if intake.admit else []
        for request in candidates:
            if count >= intake.share or room <= 0:
                break
            if any(request is r for r in batch.drop + batch.swap_out):
                continue  # preempted for an older request's chunk in this very batch
            is_new = request not in pool.running
            if is_new and len(pool.running) >= pool.config.max_running:
                break
            if request.kv == "kept":  # resumed where it stopped: it decodes from the next batch
                request.kv = "resident"
                pool.admit(request)
                continue
            if request.kv == "swapped":
                if not self._swap_in(request, batch, intake):
                    break
                continue  # it decodes from the next micro-batch on
            cached = self._expected_hit(request, intake.kv)
            if cached is None:  # its next blocks are being computed: it reuses them next step
                continue
            chunk = self._take_chunk(request, batch, intake, room, cached, is_new)
            if chunk is None:
                break
            room -= chunk - cached
            count += 1
            if is_new:
                pool.admit(request)

    def _swap_in(self, request: RequestState, batch: MicroBatch, intake: Intake) -> bool:
        """Bring a swapped-out request's KV back (False: no room for it)."""
        assert intake.kv is not None
        tokens = request.num_tokens + self.pool.tree_capacity(request)
        need = intake.kv.blocks_needed(request.request_id, tokens)
        if not self._make_room(request, need, batch, intake, may_preempt=False):
            return False
        request.kv = "resident"
        batch.swap_in.append(request)
        self.pool.admit(request)
        return True

    def _take_chunk(
        self,
        request: RequestState,
        batch: MicroBatch,
        intake: Intake,
        room: int,
        cached: int,
        is_new: bool,
    ) -> int | None:
        """Add the request's next prompt chunk; returns its size (None: no KV room for it)."""
        self._attach_prefix(request, intake.kv)
        chunk = min(room + cached, len(request.prefill_tokens) - request.num_prefilled)
        if intake.kv is not None:
            need = intake.kv.blocks_needed(request.request_id, chunk)
            # an admitted request's next chunk may preempt later admissions (else partial
            # prefills could hold every block and none could finish); a new one only moves
            # out the KV of kept requests the policy puts after it
            if not self._make_room(request, need, batch, intake, may_preempt=not is_new):
                return None
        request.kv = "resident"
        batch.prefill.append((request, chunk))
        self._expect_blocks(batch, request, chunk, cached)
        return chunk

    def _make_room(
        self,
        request: RequestState,
        need: int,
        batch: MicroBatch,
        intake: Intake,
        *,
        may_preempt: bool,
    ) -> bool:
        """Free KV until `need` blocks are free for `request`: move out kept requests' KV, and
        where `may_preempt`, preempt idle requests the policy orders after it. True (and the
        blocks taken from `intake.free`) if that was enough."""
        kv = intake.kv
        assert kv is not None
        while need > intake.free:
            released = self._evict_kept(request, batch, kv, intake.ctx)
            if not released and may_preempt:
                released = self._preempt_after(request, batch, kv, intake.ctx)
            if not released:
                return False
            intake.free += released
        intake.free -= need
        return True

    def _pick_decoding(
        self, decoding: list[RequestState], limit: int, num_micro_batches: int
    ) -> list[RequestState]:
        """Up to `limit` of the idle decoding requests (in the policy's order) for the next
        micro-batch; with the per-draft split, at most 1/M of each draft model's decoding
        requests (idle or in flight; a request counts under the model it drafted with last)."""
        if self.pool.config.micro_batch_split == "policy" or num_micro_batches == 1:
            return decoding[:limit]
        counts = Counter(r.draft_model for r in self.pool.running if not r.is_prefilling)
        taken: Counter[str | None] = Counter()
        picked: list[RequestState] = []
        for request in decoding:
            if len(picked) >= limit:
                break
            model = request.draft_model
            if taken[model] < math.ceil(counts[model] / num_micro_batches):
                taken[model] += 1
                picked.append(request)
        return picked

    # ---- prefix cache --------------------------------------------------------------------------
    def _attach_prefix(self, request: RequestState, kv: KVView | None) -> None:
        """Before a request's first chunk: what of it the executor's prefix cache holds counts
        as prefilled (budget and KV need only the rest). Not for requests whose feature-level
        drafts need the target's features of every position: the verifier looks those up with
        the features kept beside the blocks, and returns both (`_expected_hit` sizes them)."""
        if request.prefix_looked_up or request.num_prefilled or self.pool.wants_features(request):
            return
        if request.params.prompt_logprobs is not None:  # needs every prompt position's logits
            return
        attach = getattr(kv, "attach_prefix", None)
        if attach is None:
            return
        request.prefix_looked_up = True
        hit = attach(request.request_id, request.prefill_tokens)
        request.num_prefilled = hit
        if not request.output:
            request.num_cached_prompt_tokens = hit

    def _expected_hit(self, request: RequestState, kv: KVView | None) -> int | None:
        """The tokens of a request's next chunk the verifier should find cached (by the prefix
        index; 0 where the KV view attaches prefixes itself, or the verifier looks nothing up);
        None when the block after them is in a chunk in flight, so that a prefix shared by
        requests arriving together is computed once."""
        index = self.pool.prefix_index
        if index is None:
            return 0
        tokens, start = request.prefill_tokens, request.num_prefilled
        hit = 0
        attaches = getattr(kv, "attach_prefix", None) is not None
        verifier_looks_up = not attaches or self.pool.wants_features(request)
        if verifier_looks_up and request.params.prompt_logprobs is None:
            hit = index.cached_tokens(tokens, start, len(tokens))
        return None if index.pending_at(tokens, start + hit) else hit

    def _expect_blocks(
        self, batch: MicroBatch, request: RequestState, chunk: int, cached: int
    ) -> None:
        index = self.pool.prefix_index
        if index is None:
            return
        start = request.num_prefilled
        if cached:
            batch.prefill_cached[request.request_id] = cached
        index.mark_pending(batch.id, request.prefill_tokens, start + cached, start + chunk)

    # ---- preemption ----------------------------------------------------------------------------
    def preempt(
        self, victim: RequestState, batch: MicroBatch, kv: KVView | None, *, keep: bool = False
    ) -> int:
        """Move a running request back to the front of the queue. With `keep` (and its prompt
        prefilled) its KV, the verifier's and the drafter's, stays where it is; otherwise it is
        moved out (`_move_out`). Returns the target blocks released."""
        self.pool.requeue(victim)
        if keep and not victim.is_prefilling:
            victim.kv = "kept"
            self.pool.preemptions["kept"] += 1
            return 0
        self.pool.release_draft(victim)
        return self._move_out(victim, batch, kv)

    def _preempt_after(
        self, keep: RequestState, batch: MicroBatch, kv: KVView, ctx: PolicyContext
    ) -> int:
        """Preempt the last idle request that the policy orders after `keep` (for FCFS: the
        most recent arrival); returns the blocks released, 0 when there is none."""
        for victim in reversed(self.pool.policy.order(self.pool.running, ctx)):
            if victim is keep:
                return 0  # only requests the policy puts after `keep` may be preempted for it
            in_batch = victim in batch.decode or any(victim is r for r, _ in batch.prefill)
            if not victim.in_flight and not in_batch and victim.kv == "resident":
                return self.preempt(victim, batch, kv)
        return 0

    def _move_out(self, victim: RequestState, batch: MicroBatch, kv: KVView | None) -> int:
        """Free a preempted request's target KV: swap where the executor can (and the KV is
        whole), recompute otherwise; returns the target blocks released."""
        released = kv.blocks_held(victim.request_id) if kv is not None else 0
        if kv is not None and kv.can_swap and not victim.is_prefilling:
            victim.kv = "swapped"
            batch.swap_out.append(victim)
            self.pool.preemptions["swapped"] += 1
        else:
            self.pool.release_target(victim)
            batch.drop.append(victim)
            self.pool.preemptions["recomputed"] += 1
        return released

    def _resume_kept(self, ctx: PolicyContext) -> None:
        """Kept requests rejoin the running set in the policy's order while there is room,
        up to the first waiting request that must be prefilled or swapped in first."""
        pool = self.pool
        for request in pool.policy.order(pool.waiting, ctx):
            if request.kv != "kept" or len(pool.running) >= pool.config.max_running:
                break
            request.kv = "resident"
            pool.admit(request)

    def _evict_kept(
        self, keep: RequestState, batch: MicroBatch, kv: KVView, ctx: PolicyContext
    ) -> int:
        """Move out the KV of the kept request the policy orders last: for a running request,
        whichever that is (what runs must progress, or kept requests could hold every block
        while it waits); for a waiting one, only if it comes after `keep`. Returns the blocks
        released, 0 when there is none."""
        kept = [r for r in self.pool.waiting if r.kv == "kept"]
        if not kept:
            return 0
        is_running = keep in self.pool.running
        victim = self.pool.policy.order(kept if is_running else [*kept, keep], ctx)[-1]
        if victim is keep:
            return 0
        self.pool.release_draft(victim)
        return self._move_out(victim, batch, kv)
