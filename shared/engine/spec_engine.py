"""The in-process engine: one target, its drafters and the scheduler core, in one loop.

This is the whole system in one process (no Redis), used by the CLI, the benchmarks and the
tests. It is one of the core's executors (the scheduler service is another), so every decision
(admission, preemption, draft model, speculation depth, tree selection) is the core's; the engine
owns the models and their KV, and turns the core's plan into forwards. A step reads as three
lines: schedule, run, observe.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from shared.engine.drafting import Drafter
from shared.engine.methods import DraftMethod, tree_capacity
from shared.engine.sampling import SEED_BITS, SamplingParams
from shared.engine.tree import TokenTree
from shared.engine.verifier import Verifier
from shared.errors import InvalidRequestError, OutOfKVMemoryError
from shared.model.kv_cache import SwappedKV
from shared.scheduling.core import (
    CoreConfig,
    MergePolicy,
    MicroBatch,
    SchedulerCore,
    SpeculationPlanner,
    StepOutput,
    StepResult,
    draft_request,
)
from shared.scheduling.cost_model import CostModel
from shared.scheduling.draft_choice import make_chooser
from shared.scheduling.ordering import make_policy
from shared.scheduling.request import AcceptanceStats, RequestState
from shared.scheduling.slo_classes import effective_class, resolve_tpot_slo
from shared.scheduling.tree_selection import make_selector
from shared.settings import LapsSettings, LbssSettings, SloSettings
from shared.wire.steps import DraftRequest, VerifyRequest

# Sees each verified micro-batch (selected trees in `batch.trees`) and its results before the core
# commits them; `bench.acceptance` records acceptance this way.
StepObserver = Callable[[MicroBatch, Mapping[str, StepResult]], None]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens_per_step: int = Field(512, ge=1)  # B: prompt chunks and trees of one forward
    max_running: int = Field(64, ge=1)
    policy: str = "fcfs"
    length_predictor: str | None = None  # for lp-sjf and laps-sd; None: "learned"
    laps: LapsSettings = LapsSettings()
    draft_chooser: str = "fixed"  # fixed, lbss, greedy-length, eps-greedy
    lbss: LbssSettings = LbssSettings()
    fast_switching: bool = False  # keep a standby draft's KV in step (Spin's fast switching)
    merge_drafts: MergePolicy = "off"  # the standby also drafts a tree, merged (SpecInfer)
    tree_selection: str = "goodput"
    planner: SpeculationPlanner = "goodput"
    slo: SloSettings = SloSettings()  # SLO classes (add_request) and the SLO-aware selectors


class RunnerKV:
    """The verifier's paged cache as the core sees it (block counts only), and its prefix
    cache (`attach_prefix`, a `PrefixKVView`)."""

    can_swap = True

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self.runner = verifier.runner

    def attach_prefix(self, request_id: str, tokens: Sequence[int]) -> int:
        return self.verifier.attach_prefix(request_id, tokens)

    def num_free_blocks(self) -> int:
        return self.runner.cache.allocator.num_free

    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        return self.runner.blocks_needed(request_id, num_new_tokens)

    def blocks_held(self, request_id: str) -> int:
        if not self.runner.has_request(request_id):
            return 0
        return self.runner.cache.num_blocks_alone(request_id)


class SpecEngine:
    def __init__(
        self,
        verifier: Verifier,
        drafter: Drafter | Mapping[str, Drafter] | None = None,
        method: DraftMethod | None = None,
        config: EngineConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        *,
        cost: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: StepObserver | None = None,
    ) -> None:
        self.verifier = verifier
        if isinstance(drafter, Drafter):
            drafter = {drafter.name: drafter}
        self.drafters: dict[str, Drafter] = dict(drafter or {})
        self.config = config or EngineConfig()
        self.clock = clock
        self.observer = observer
        runner = verifier.runner
        self.core = SchedulerCore(
            CoreConfig(
                vocab_size=runner.cfg.vocab_size,
                max_context=runner.max_context,
                eos_token_ids=tuple(eos_token_ids),
                token_budget=self.config.max_tokens_per_step,
                max_running=self.config.max_running,
                method=method if self.drafters else None,
                planner=self.config.planner,
                feature_drafts=frozenset(
                    name for name, d in self.drafters.items() if d.is_feature_level
                ),
                feature_size=runner.cfg.hidden_size,
                fast_switching=self.config.fast_switching,
                merge_drafts=self.config.merge_drafts,
            ),
            policy=make_policy(self.config.policy, self.config.length_predictor, self.config.laps),
            chooser=make_chooser(self.config.draft_chooser, list(self.drafters), self.config.lbss),
            selector=make_selector(self.config.tree_selection, self.config.slo),
            cost=cost,
        )
        self.core.set_drafters({name: ["local"] for name in self.drafters})
        self.kv = RunnerKV(verifier)
        self.requests: dict[str, RequestState] = {}  # every request given, until popped
        self._swapped: dict[str, SwappedKV] = {}
        self._ids = 0

    @property
    def stats(self) -> AcceptanceStats:
        """Speculation counters of every verified decode step so far."""
        return self.core.stats

    @property
    def drafter(self) -> Drafter | None:
        """The first drafter (the engine's only one in the common single-draft set-up)."""
        return next(iter(self.drafters.values()), None)

    # ---- admission -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        tpot_slo_ms: float | None = None,
        draft_model: str | None = None,
        speculate: bool = True,
        method: DraftMethod | None = None,
        slo_class: str | None = None,
    ) -> str:
        """Queue a request; bad input raises an `AuguryError` naming the limit.

        `slo_class` names one of `config.slo.classes`: the objective is its multiple of the
        baseline latency (`config.slo.baseline_latency_ms`, else the cost model's); an explicit
        `tpot_slo_ms` wins over it."""
        self.core.check(prompt, params.max_tokens)
        runner = self.verifier.runner
        capacity = tree_capacity(self.core.config.method)
        need = runner.cache.num_blocks_for(len(prompt) + params.max_tokens + capacity)
        if need > runner.cache.num_blocks:
            raise OutOfKVMemoryError(
                f"request needs {need} KV blocks, more than the cache's {runner.cache.num_blocks}"
            )
        if draft_model is not None and draft_model not in self.drafters:
            raise InvalidRequestError(
                f"unknown draft model {draft_model!r}; known: {sorted(self.drafters)}",
                param="draft_model",
            )
        slo = self.config.slo
        objective_ms = resolve_tpot_slo(slo_class, tpot_slo_ms, slo, self.core.cost)
        if request_id is None:
            request_id = f"req-{self._ids}"
            self._ids += 1
        seed = params.seed if params.seed is not None else secrets.randbits(SEED_BITS)
        request = RequestState(
            request_id,
            list(prompt),
            params,
            seed,
            arrival_time=self.clock(),
            priority=priority,
            tpot_slo_ms=objective_ms,
            slo_class=effective_class(slo_class, tpot_slo_ms, slo),
            requested_draft=draft_model,
            speculate=speculate,
            method=method,
        )
        self.core.add(request)
        self.requests[request_id] = request
        return request_id

    def abort(self, request_id: str) -> None:
        self.core.cancel(request_id)
        self._release()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.core.next_batch(self.clock(), self.kv)
        if batch is None:
            return []
        results = self._run(batch)
        if self.observer is not None:
            self.observer(batch, results)
        outputs = batch.failed + self.core.observe(batch, results, self.clock())
        self._release()
        return outputs

    def _run(self, batch: MicroBatch) -> dict[str, StepResult]:
        runner = self.verifier.runner
        for request in batch.swap_out:
            self._swapped[request.request_id] = runner.swap_out(request.request_id)
        for request in batch.swap_in:
            runner.swap_in(request.request_id, self._swapped.pop(request.request_id))
        self._release()  # drafts left behind by preemption or a change of draft model
        drafted, partners = self._draft(batch)
        trees = self.core.select_trees(batch, drafted, self.clock(), partners)
        entries = [
            VerifyRequest(
                r.request_id,
                r.step,
                r.params,
                r.seed,
                r.tokens_left,
                chunk=tuple(r.prefill_tokens[r.num_prefilled : r.num_prefilled + chunk]),
                chunk_start=r.num_prefilled,
                chunk_is_last=r.num_prefilled + chunk == len(r.prefill_tokens),
                want_features=self.core.wants_features(r),
            )
            for r, chunk in batch.prefill
        ]
        entries += [
            VerifyRequest(
                r.request_id,
                r.step,
                r.params,
                r.seed,
                r.tokens_left,
                tree=trees[r.request_id],
                want_features=self.core.wants_features(r),
            )
            for r in batch.decode
        ]
        verified = self.verifier.step(entries) if entries else []
        return {
            v.request_id: StepResult(
                v.request_id,
                v.step,
                v.new_tokens,
                len(v.accepted),
                features=v.features,
                cached_tokens=v.cached_tokens,
            )
            for v in verified
        }

    def _draft(self, batch: MicroBatch) -> tuple[dict[str, TokenTree], dict[str, TokenTree]]:
        """The step's trees, and the standby drafters' trees to merge with them (`batch.merge`);
        fast switching's warm-ups (`batch.warm`) run beside them and only bring the standby
        drafters' KV in step. A request's own drafter and its standby are different models."""
        standby = batch.standby_plans
        groups: dict[tuple[str, DraftMethod], list[DraftRequest]] = {}
        for rid, plan in [*batch.drafts.items(), *standby.items()]:
            request = self.core.requests[rid]
            drafter = self.drafters[plan.model]
            if plan.base_len == 0 and drafter.runner.has_request(rid):
                drafter.free(rid)  # the core starts this drafter's copy over
            groups.setdefault((plan.model, plan.method), []).append(draft_request(request, plan))
        trees: dict[str, TokenTree] = {}
        partners: dict[str, TokenTree] = {}
        for (model, method), requests in groups.items():
            drafted = self.drafters[model].draft(requests, method.for_batch(len(requests)))
            for r in requests:
                rid = r.request_id
                if rid in standby and standby[rid].model == model:
                    self.core.note_warmed(rid, standby[rid], True)
                    if rid in batch.merge:
                        partners[rid] = drafted[rid]
                else:
                    self.core.note_drafted(rid, True)
                    trees[rid] = drafted[rid]
        return trees, partners

    def _release(self) -> None:
        for release in self.core.take_releases():
            if release.target:
                self.verifier.free(release.request_id)
                self._swapped.pop(release.request_id, None)
            if release.draft is not None:
                self.drafters[release.draft[0]].free(release.request_id)

    # ---- conveniences -------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestState]:
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
