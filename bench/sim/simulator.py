"""The scheduler core on a virtual clock: the core's own decisions, measured costs, recorded
acceptance, and no model.

The simulator is a third executor of `SchedulerCore` (beside the in-process engine and the
scheduler service), driving it exactly as they do: `next_batch`, drafting, `select_trees`,
verification, `observe`. What it replaces is the work:

- drafting a request returns the tree a real drafter proposed at that step of a recorded session
  of the request's kind (`bench.sim.acceptance`), cut at the depth the core planned; a request
  follows one recorded prompt under every draft, so a changed draft continues the same text;
- verification accepts what the target accepted of that tree, restricted to the selected subtree;
- a request ends at its recorded length: by an end-of-sequence token where that is short of the
  `max_tokens` it carries (as the target ends an answer), else at `max_tokens`; so the scheduler
  and its length predictors see only the cap a client would send, never the answer's length;
- time comes from the cost profile: drafting a micro-batch costs `CostModel.draft_tree_ms` per
  draft model, verifying it `CostModel.verify_ms` over every prompt-chunk and tree node, plus a
  per-step overhead (scheduling, messaging, contention, which no forward measures): a fixed
  part plus a part growing with the square root of the decoding requests (`bench.sim.calibrate`
  measures both from a running scheduler).

Up to M micro-batches are in flight (the core's `micro_batches`). Devices are FIFO servers: the
verifier, and each draft model's drafter, unless `shared_device` (one host whose processes take
turns on the same cores, as on a CPU machine) makes them one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.load.records import RequestRecord
from bench.sim.acceptance import AcceptanceModel, Session
from bench.sim.prefix import hashed_prompt
from shared.scheduling.core import (
    CoreConfig,
    MicroBatch,
    SchedulerCore,
    StepOutput,
    StepResult,
    mean_context,
)
from shared.scheduling.cost_model import CostModel
from shared.scheduling.factory import make_chooser, make_policy, make_selector
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.request import RequestState
from shared.settings import LapsSettings, LbssSettings, SloSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.tree import TokenTree

PROMPT_TOKEN = 1  # simulated prompts and bonus tokens; only counts matter
BONUS_TOKEN = 2
EOS_TOKEN = 3  # ends a request at its recorded length


def step_overhead_ms(fixed_ms: float, per_request_ms: float, num_decoding: int) -> float:
    """A micro-batch's time outside the forwards: fixed + per_request * sqrt(decoding)."""
    return fixed_ms + per_request_ms * math.sqrt(num_decoding)


@dataclass(frozen=True)
class SimConfig:
    vocab_size: int = 49152
    max_context: int = 8192
    token_budget: int = 512  # B, as `engine.max_tokens_per_step`
    max_running: int = 64  # as `scheduler.max_running_requests`
    micro_batches: int = 1  # as `scheduler.micro_batches` (with auto: the most in flight)
    auto_micro_batches: bool = False  # as `scheduler.micro_batches = auto`
    micro_batch_drop: float = 0.1
    micro_batch_split: str = "policy"  # as `scheduler.micro_batch_split`
    policy: str = "fcfs"
    length_predictor: str | None = None  # for lp-sjf and laps-sd; None: "learned"
    laps: LapsSettings = field(default_factory=LapsSettings)
    selector: str = "goodput"
    slo: SloSettings = field(default_factory=SloSettings)  # for the SLO-aware selectors
    draft_chooser: str = "fixed"
    lbss: LbssSettings = field(default_factory=LbssSettings)  # for draft_chooser "lbss"
    fast_switching: bool = False  # as `scheduler.fast_switching`
    oracle: dict[str, str] = field(default_factory=dict)  # "oracle": request id -> best draft
    planner: str = "goodput"
    drafts: tuple[str, ...] = ("draft-s",)
    method: DraftMethod | None = None  # None: the acceptance recording's method
    shared_device: bool = True
    # time of a micro-batch outside the forwards (scheduling, messages, contention on a shared
    # host): step_overhead_ms + request_overhead_ms * sqrt(decoding requests), as measured from
    # the scheduler service's DEBUG log by `bench.sim.calibrate`
    step_overhead_ms: float = 0.0
    request_overhead_ms: float = 0.0
    # prefix caching (`bench/sim/prefix.py`): the verifier's cache of `block_size`-token blocks
    # (at most `prefix_cache_blocks`, least recently used out) and the core's index of it
    prefix_caching: bool = False
    block_size: int = 16
    prefix_cache_blocks: int = 1 << 20


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int  # the answer's length: where it ends
    kind: str | None = None
    slo_class: str | None = None
    tpot_slo_ms: float | None = None
    priority: int = 0
    # the prompt's token ids where known (a length predictor reads them); else placeholders
    prompt_tokens: tuple[int, ...] | None = None
    session_key: int | None = None  # which recorded prompt of its kind it follows; None: index
    # the cap the request carries, as a client's max_tokens (at least num_output_tokens); None:
    # num_output_tokens, which tells the scheduler the length (only where nothing predicts it)
    max_tokens: int | None = None
    # Mooncake's prefix block hashes: the prompt's tokens are drawn from them (with
    # `prompt_tokens` None), so that requests share what the trace says they share
    hash_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < self.num_output_tokens:
            raise ValueError(
                f"max_tokens {self.max_tokens} is below the answer of {self.num_output_tokens}"
            )


@dataclass(order=True)
class _InFlight:
    done_at: float
    order: int
    batch: MicroBatch = field(compare=False)
    results: dict[str, StepResult] = field(compare=False)


class Simulator:
    def __init__(self, config: SimConfig, cost: CostModel, acceptance: AcceptanceModel) -> None:
        missing = [d for d in config.drafts if d not in acceptance.drafts]
        if missing:
            raise ValueError(
                f"no recorded acceptance for draft(s) {missing} (recorded: {acceptance.drafts})"
            )
        missing = [d for d in config.drafts if not cost.has_draft(d)]
        if missing:
            raise ValueError(f"the cost profile has no draft(s) {missing} ({cost.draft_models})")
        self.config = config
        self.cost = cost
        self.acceptance = acceptance
        # request -> its answer's length: where the simulator ends it, and what only the
        # `oracle` length predictor is given
        self._lengths: dict[str, int] = {}
        method = config.method or acceptance.method
        self.core = SchedulerCore(
            CoreConfig(
                vocab_size=config.vocab_size,
                max_context=config.max_context,
                eos_token_ids=(EOS_TOKEN,),
                token_budget=config.token_budget,
                max_running=config.max_running,
                micro_batches=config.micro_batches,
                auto_micro_batches=config.auto_micro_batches,
                micro_batch_drop=config.micro_batch_drop,
                micro_batch_split=config.micro_batch_split,  # type: ignore[arg-type]
                method=method if config.drafts else None,
                planner=config.planner,  # type: ignore[arg-type]
                fast_switching=config.fast_switching,
            ),
            policy=make_policy(config.policy, config.length_predictor, config.laps, self._lengths),
            chooser=make_chooser(
                config.draft_chooser, list(config.drafts), config.lbss, config.oracle
            ),
            selector=make_selector(config.selector, config.slo),
            cost=cost,
            # the core's index as large as the cache it mirrors (it forgets no more than that)
            prefix_index=(
                PrefixIndex(config.block_size, max_blocks=config.prefix_cache_blocks)
                if config.prefix_caching
                else None
            ),
        )
        # the simulated verifier's prefix cache, and its count of prompt tokens (vLLM's queries
        # and hits; a recomputed request's tokens count again)
        self.verifier_cache = (
            PrefixIndex(config.block_size, max_blocks=config.prefix_cache_blocks)
            if config.prefix_caching
            else None
        )
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.core.set_drafters({name: ["sim"] for name in config.drafts})
        self.records: dict[str, RequestRecord] = {}
        self._kinds: dict[str, str | None] = {}
        self._session_keys: dict[str, int] = {}
        # the recorded prompt a request follows under every draft (None: none recorded by all)
        self._prompts: dict[str, tuple[str, int] | None] = {}
        self._sessions: dict[tuple[str, str], Session] = {}  # (request, draft) -> session
        self._text_at: dict[str, int] = {}  # request -> where its recorded text has got to
        self._free_at: dict[str, float] = {}  # device -> when it is next free
        self._order = itertools.count()

    # ---- the run ---------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest]) -> list[RequestRecord]:
        """Serve every request; one record per request, in the order given."""
        arrivals = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        in_flight: list[_InFlight] = []
        now = 0.0
        next_arrival = 0
        while next_arrival < len(arrivals) or self.core.has_unfinished() or in_flight:
            while next_arrival < len(arrivals):
                index = arrivals[next_arrival]
                if requests[index].arrival_s > now:
                    break
                self._add(index, requests[index])
                next_arrival += 1
            while len(in_flight) < self.config.micro_batches:
                batch = self.core.next_batch(now)
                if batch is None:
                    break
                self._outputs(batch.failed, now)
                heapq.heappush(in_flight, self._dispatch(batch, now))
            times = [f.done_at for f in in_flight[:1]]
            if next_arrival < len(arrivals):
                times.append(requests[arrivals[next_arrival]].arrival_s)
            if not times:
                stuck = len(self.core.requests)
                raise RuntimeError(f"the core scheduled nothing with {stuck} requests waiting")
            now = max(now, min(times))
            while in_flight and in_flight[0].done_at <= now:
                done = heapq.heappop(in_flight)
                self._outputs(self.core.observe(done.batch, done.results, now), now)
                self.core.take_releases()  # no memory to free on a virtual clock
        return [self.records[f"sim-{i}"] for i in range(len(requests))]

    def _add(self, index: int, request: SimRequest) -> None:
        rid = f"sim-{index}"
        cap = request.num_output_tokens if request.max_tokens is None else request.max_tokens
        params = SamplingParams(max_tokens=cap)
        self._lengths[rid] = request.num_output_tokens
        prompt = request.prompt_tokens or (PROMPT_TOKEN,) * request.num_prompt_tokens
        if request.prompt_tokens is None and request.hash_ids is not None:
            prompt = hashed_prompt(
                request.hash_ids, request.num_prompt_tokens, self.config.vocab_size
            )
        state = RequestState(
            rid,
            list(prompt),
            params,
            seed=index,
            arrival_time=request.arrival_s,
            priority=request.priority,
            tpot_slo_ms=request.tpot_slo_ms,
        )
        record = RequestRecord(
            index=index,
            arrival_s=request.arrival_s,
            num_prompt_tokens=request.num_prompt_tokens,
            kind=request.kind,
            slo_class=request.slo_class,
            tpot_slo_ms=request.tpot_slo_ms,
        )
        self.records[rid] = record
        self._kinds[rid] = request.kind
        self._session_keys[rid] = index if request.session_key is None else request.session_key
        try:
            self.core.add(state)
        except ValueError as error:  # refused (too long for the context): a failed request
            record.error = str(error)
            record.finish_s = request.arrival_s

    # ---- one micro-batch -------------------------------------------------------------------
    def _dispatch(self, batch: MicroBatch, now: float) -> _InFlight:
        drafted: dict[str, TokenTree] = {}
        sessions: dict[str, tuple[Session, int]] = {}
        draft_done = now
        by_model: dict[str, list[str]] = {}
        for rid, plan in batch.drafts.items():
            by_model.setdefault(plan.model, []).append(rid)
        for model, rids in sorted(by_model.items()):
            layers: dict[int, int] = {}
            root_tokens = 0
            for rid in rids:
                plan = batch.drafts[rid]
                session, step = self._session_step(rid, model)
                tree, sizes = self.acceptance.drafted(session, step, plan.max_depth, plan.method)
                drafted[rid] = tree
                sessions[rid] = (session, step)
                root_tokens += len(plan.new_tokens)
                for depth, size in enumerate(sizes, start=1):
                    layers[depth] = layers.get(depth, 0) + size
                self.core.note_drafted(rid, True)
            ms = self.cost.draft_tree_ms(
                model,
                root_tokens,
                [layers[d] for d in sorted(layers)] or [0],
                mean_context([self.core.requests[r] for r in rids]),
                len(rids),
            )
            draft_done = max(draft_done, self._occupy(f"draft:{model}", now, ms))
        self._warm(batch, now)
        trees = self.core.select_trees(batch, drafted, draft_done)
        results = self._verify(batch, trees, sessions)
        # what the core expected cached and the verifier did not find: computed all the same
        missed = sum(n - results[rid].cached_tokens for rid, n in batch.prefill_cached.items())
        num_tokens = batch.prefill_tokens + missed + sum(t.num_nodes for t in trees.values())
        ms = self.cost.verify_ms(num_tokens, mean_context(batch.members), len(batch.members))
        ms += max(0.0, self.overhead_ms(len(batch.decode)))
        done = self._occupy("verifier", draft_done, ms)
        return _InFlight(done, next(self._order), batch, results)

    def _warm(self, batch: MicroBatch, now: float) -> None:
        """Fast switching's warm-ups: each standby draft appends the committed tokens it lacks,
        on its own device once that is free (after its part of this step's drafting); the step
        does not wait for them unless the device is shared."""
        by_model: dict[str, list[str]] = {}
        for rid, plan in batch.warm.items():
            by_model.setdefault(plan.model, []).append(rid)
        for model, rids in sorted(by_model.items()):
            tokens = sum(len(batch.warm[rid].new_tokens) for rid in rids)
            context = mean_context([self.core.requests[r] for r in rids])
            self._occupy(f"draft:{model}", now, self.cost.draft_forward_ms(model, tokens, context))
            for rid in rids:
                self.core.note_warmed(rid, batch.warm[rid], True)

    def overhead_ms(self, num_decoding: int) -> float:
        return step_overhead_ms(
            self.config.step_overhead_ms, self.config.request_overhead_ms, num_decoding
        )

    def _occupy(self, device: str, ready: float, ms: float) -> float:
        """Run `ms` of work on `device` once it is free and the input is `ready`; when it ends."""
        if self.config.shared_device:
            device = "device"
        start = max(ready, self._free_at.get(device, 0.0))
        self._free_at[device] = start + ms / 1000
        return self._free_at[device]

    def _session_step(self, rid: str, model: str) -> tuple[Session, int]:
        """The recorded session and step a request drafts from with `model`: the session of the
        request's prompt under that draft (the same prompt under every draft), at the first step
        it recorded where the text has got to. With one draft that is the next step, wrapping
        round; a request whose draft changes continues the same text."""
        key = (rid, model)
        session = self._sessions.get(key)
        if session is None:
            if rid not in self._prompts:
                self._prompts[rid] = self.acceptance.prompt_for(
                    self._kinds[rid], self._session_keys[rid], self.config.drafts
                )
            session = self.acceptance.session_for(
                self._kinds[rid], model, self._session_keys[rid], self._prompts[rid]
            )
            self._sessions[key] = session
        step = session.step_at(self._text_at.get(rid, 0))
        self._text_at[rid] = session.end_of(step)
        return session, step

    def _verify(
        self,
        batch: MicroBatch,
        trees: dict[str, TokenTree],
        sessions: dict[str, tuple[Session, int]],
    ) -> dict[str, StepResult]:
        results: dict[str, StepResult] = {}
        for request, chunk in batch.prefill:
            is_last = request.num_prefilled + chunk == len(request.prefill_tokens)
            tokens = (BONUS_TOKEN,) if is_last else ()
            cached = self._prefill_cached(request, chunk)
            results[request.request_id] = StepResult(
                request.request_id, request.step, tokens, cached_tokens=cached
            )
        for request in batch.decode:
            rid = request.request_id
            tree = trees[rid]
            accepted = 0
            if tree.num_nodes > 1 and rid in sessions:
                session, step = sessions[rid]
                accepted = self.acceptance.num_accepted(session, step, tree)
            tokens = self._committed(request, accepted + 1)  # only their number matters
            results[rid] = StepResult(rid, request.step, tokens, min(accepted, len(tokens) - 1))
        return results

    def _prefill_cached(self, request: RequestState, chunk: int) -> int:
        """The chunk's first tokens the verifier finds cached (as `Verifier.step` looks them
        up); its blocks are cached from then on."""
        start, tokens = request.num_prefilled, request.prefill_tokens
        self.prompt_tokens += chunk
        cache = self.verifier_cache
        if cache is None:
            return 0
        cached = 0
        if not self.core.wants_features(request):
            cached = cache.cached_tokens(tokens, start, start + chunk)
        cache.insert(tokens, start + chunk)
        self.cached_prompt_tokens += cached
        return cached

    def _committed(self, request: RequestState, count: int) -> tuple[int, ...]:
        """`count` tokens the target commits, ending with EOS where they reach the recorded
        length before the request's cap (EOS is the target's token too: it takes one of them)."""
        left = self._lengths[request.request_id] - len(request.output)
        if left >= count or left >= request.tokens_left:
            return (BONUS_TOKEN,) * count
        return (BONUS_TOKEN,) * max(0, left) + (EOS_TOKEN,)

    def _outputs(self, outputs: Sequence[StepOutput], now: float) -> None:
        for out in outputs:
            record = self.records[out.request_id]
            if out.new_tokens:
                record.chunks.append((now, len(out.new_tokens)))
                record.num_output_tokens += len(out.new_tokens)
                if record.first_token_s is None:
                    record.first_token_s = now
            if out.num_draft_tokens:
                record.drafts += 1
                record.draft_tokens += out.num_draft_tokens
                record.accepted_tokens += out.num_accepted
                if out.draft_model is not None:
                    steps = record.steps_by_draft
                    steps[out.draft_model] = steps.get(out.draft_model, 0) + 1
            if out.finish_reason is not None:
                record.finish_s = now
                if out.error is not None or out.finish_reason == "abort":
                    record.error = out.error or "aborted"
                else:
                    record.finish_reason = out.finish_reason
