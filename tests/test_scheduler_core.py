"""The scheduler core driven by a fake executor: no models, no tensors, no I/O.

The fake target is deterministic (next token = (last * 7 + 3) % VOCAB), the fake drafter proposes
trees that agree with it with a configurable probability, and a fake KV view counts blocks. The
executor does what the real ones do (apply preemptions, draft, select, verify, observe, free
what the core releases) and checks on the way that the core's bookkeeping matches its own: the
drafter holds exactly the tokens the plan says, the KV holds exactly the committed tokens.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.errors import ContextLengthError, InvalidRequestError
from shared.scheduling.core import (
    CoreConfig,
    DraftPlan,
    MicroBatch,
    SchedulerCore,
    StepOutput,
    StepResult,
)
from shared.scheduling.cost_model import (
    CostModel,
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
)
from shared.scheduling.draft_choice import FixedDraftModel
from shared.scheduling.executor import DraftKey, DraftRound, StepDriver, route_releases
from shared.scheduling.factory import make_chooser, make_policy, make_selector
from shared.scheduling.ordering import FCFS, PolicyContext
from shared.scheduling.replicas import LeastLoadedSticky, make_matcher
from shared.scheduling.request import RequestState, append_tokens
from shared.scheduling.tree_selection import GlobalGreedy, SelectionContext
from shared.values.methods import DraftMethod, tree_capacity
from shared.values.sampling import SamplingParams
from shared.values.steps import DraftedTree, VerifiedRequest, VerifyRequest
from shared.values.tree import SparseDist, TokenTree

VOCAB = 97


def target_next(token: int) -> int:
    return (token * 7 + 3) % VOCAB


def greedy(prompt: Sequence[int], n: int) -> list[int]:
    out, t = [], prompt[-1]
    for _ in range(n):
        t = target_next(t)
        out.append(t)
    return out


def make_request(
    rid: str, prompt: Sequence[int] | int = 4, max_tokens: int = 20, **kw: object
) -> RequestState:
    if isinstance(prompt, int):
        prompt = [(i * 5 + len(rid)) % VOCAB for i in range(1, prompt + 1)]
    params = SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return RequestState(rid, list(prompt), params, seed=1)


# ---- the fake executor ---------------------------------------------------------------------------
class FakeKV:
    """Block counts of a paged cache; requests hold the tokens verified for them."""

    def __init__(self, num_blocks: int = 10_000, block_size: int = 4, can_swap: bool = True):
        self.total = num_blocks
        self.bs = block_size
        self.can_swap = can_swap
        self.cached: dict[str, int] = {}  # resident: tokens in the cache
        self.held: dict[str, int] = {}  # resident: blocks
        self.swapped: dict[str, int] = {}  # on the host: tokens

    def num_free_blocks(self) -> int:
        return self.total - sum(self.held.values())

    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        if request_id in self.held:
            have = self.cached[request_id]
            return max(0, math.ceil((have + num_new_tokens) / self.bs) - self.held[request_id])
        return math.ceil(num_new_tokens / self.bs)

    def blocks_held(self, request_id: str) -> int:
        return self.held.get(request_id, 0)

    def grow(self, request_id: str, n: int) -> bool:
        need = self.blocks_needed(request_id, n)
        if need > self.num_free_blocks():
            return False
        self.held[request_id] = self.held.get(request_id, 0) + need
        self.cached[request_id] = self.cached.get(request_id, 0) + n
        return True

    def trim(self, request_id: str, tokens: int) -> None:
        self.cached[request_id] = tokens
        self.held[request_id] = math.ceil(tokens / self.bs)

    def free(self, request_id: str) -> None:
        self.cached.pop(request_id, None)
        self.held.pop(request_id, None)
        self.swapped.pop(request_id, None)

    def swap_out(self, request_id: str) -> None:
        assert self.can_swap
        self.swapped[request_id] = self.cached.pop(request_id)
        self.held.pop(request_id)

    def swap_in(self, request_id: str) -> None:
        tokens = self.swapped.pop(request_id)
        need = math.ceil(tokens / self.bs)
        assert need <= self.num_free_blocks(), "the core swapped in without room"
        self.held[request_id], self.cached[request_id] = need, tokens


class FakeDrafters:
    """Per (model, replica, request) the committed tokens a drafter holds; trees from a coin."""

    def __init__(self, agree: float | Mapping[str, float], rng: random.Random):
        self.agree = agree
        self.rng = rng
        self.states: dict[tuple[str, str, str], list[int] | None] = {}  # None: unknown state
        self.last: dict[tuple[str, str, str], str] = {}
        self.double_releases: list[tuple[str, str, str]] = []
        self.empty_releases: list[tuple[str, str, str]] = []

    def p_agree(self, request_id: str) -> float:
        if isinstance(self.agree, Mapping):
            return self.agree[request_id]
        return self.agree

    def draft(self, plan: DraftPlan, request: RequestState) -> TokenTree:
        key = (plan.model, plan.replica, request.request_id)
        if plan.base_len == 0:
            self.states.pop(key, None)  # the core starts this copy over
        held = self.states.get(key, [])
        assert held is not None, f"{key}: planned on top of a draft state the core lost"
        assert held == request.all_tokens[: plan.base_len], f"{key}: drafter out of step"
        held = held + list(plan.new_tokens)
        assert held == request.all_tokens, f"{key}: the plan does not bring the drafter up"
        self.states[key] = held
        self.last[key] = "created"
        return self._tree(plan, request)

    def fail(self, plan: DraftPlan, request: RequestState) -> None:
        """The drafter did not answer: its state is unknown."""
        key = (plan.model, plan.replica, request.request_id)
        self.states[key] = None
        self.last[key] = "created"

    def release(self, model: str, replica: str, request_id: str) -> None:
        key = (model, replica, request_id)
        if key in self.states:
            del self.states[key]
            self.last[key] = "released"
        elif self.last.get(key) == "released":
            self.double_releases.append(key)
        else:
            self.empty_releases.append(key)

    def _tree(self, plan: DraftPlan, request: RequestState) -> TokenTree:
        """A main path of `max_depth` tokens, each the target's with probability p, and (room
        and method allowing) one sibling per level."""
        p = self.p_agree(request.request_id)
        root = request.all_tokens[-1]
        assert plan.new_tokens[-1] == root
        tokens, parents, logq = [root], [-1], [0.0]
        node = 0
        depth = min(plan.max_depth, plan.max_nodes)
        for d in range(1, depth + 1):
            right = target_next(tokens[node])
            main = right if self.rng.random() < p else (right + 1) % VOCAB
            tokens.append(main)
            parents.append(node)
            logq.append(math.log(0.7))
            main_node = len(tokens) - 1
            room = plan.max_nodes - (len(tokens) - 1) - (depth - d)
            if plan.method.tokens_at_depth(d) > 1 and room > 0:
                other = right if main != right and self.rng.random() < 0.5 else (right + 2) % VOCAB
                tokens.append(other)
                parents.append(node)
                logq.append(math.log(0.2))
            node = main_node
        return TokenTree.build(tokens, parents, logq)


def verify_tree(tree: TokenTree) -> tuple[list[int], int]:
    """Greedy verification against the fake target: accepted path then the bonus token."""
    kids = tree.children()
    node, out = 0, []
    while True:
        want = target_next(int(tree.tokens[node]))
        out.append(want)
        nxt = next((c for c in kids[node] if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return out, len(out) - 1
        node = nxt


@dataclass
class InFlight:
    batch: MicroBatch
    results: dict[str, StepResult]


@dataclass
class FakeExecutor:
    """The executor contract's transport (`shared.scheduling.executor.Transport`), checking the
    core's bookkeeping against its own on the way."""

    core: SchedulerCore
    kv: FakeKV | None
    drafters: FakeDrafters
    rng: random.Random
    draft_failure: float = 0.0
    now: float = 0.0
    streamed: dict[str, list[int]] = field(default_factory=dict)
    finished: list[StepOutput] = field(default_factory=list)  # in finishing order
    finish_counts: Counter[str] = field(default_factory=Counter)
    target_releases_after_finish: Counter[str] = field(default_factory=Counter)
    target_releases: Counter[str] = field(default_factory=Counter)
    inflight: list[InFlight] = field(default_factory=list)
    batches: list[MicroBatch] = field(default_factory=list)
    oom_errors: int = 0
    plans: list[dict[str, DraftPlan]] = field(default_factory=list)
    warmed: list[tuple[str, DraftPlan]] = field(default_factory=list)  # standby jobs
    verified: list[TokenTree] = field(default_factory=list)  # every tree verified

    def __post_init__(self) -> None:
        self.driver = StepDriver(self.core, self)

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    # -- the transport ----------------------------------------------------------------------------
    def free_target(self, request_id: str) -> None:
        self.target_releases[request_id] += 1
        if request_id not in self.core.requests:
            self.target_releases_after_finish[request_id] += 1
        if self.kv is not None:
            self.kv.free(request_id)

    def free_draft(self, model: str, replica: str, request_id: str) -> None:
        self.drafters.release(model, replica, request_id)

    def swap_out(self, request: RequestState) -> None:
        assert self.kv is not None
        self.kv.swap_out(request.request_id)

    def swap_in(self, request: RequestState) -> None:
        assert self.kv is not None
        self.kv.swap_in(request.request_id)

    def draft(self, drafts: DraftRound) -> dict[DraftKey, DraftedTree]:
        answers: dict[DraftKey, DraftedTree] = {}
        batch = self.batches[-1]
        for job in drafts.jobs:
            rid, plan = job.entry.request_id, job.plan
            request = self.core.requests[rid]
            if job.role == "draft":
                assert request in batch.decode
            else:  # a request's standby drafter
                assert rid in batch.drafts and plan.model != request.draft_model
                assert not (rid in batch.warm and rid in batch.merge)
                self.warmed.append((rid, plan))
            if self.rng.random() < self.draft_failure:
                self.drafters.fail(plan, request)
                continue
            tree = self.drafters.draft(plan, request)
            answers[job.key] = DraftedTree(rid, job.entry.step, tree)
        return answers

    def draft_time(self) -> float:
        return self.tick()

    def verify(self, batch: MicroBatch, entries: Sequence[VerifyRequest]) -> list[VerifiedRequest]:
        trees = [e.tree for e in entries if e.tree is not None]
        assert len(trees) == len(batch.decode)
        nodes = sum(t.num_nodes for t in trees)
        assert batch.prefill_tokens + nodes <= self.core.config.token_budget
        return [self._verify_one(e) for e in entries]

    def _verify_one(self, entry: VerifyRequest) -> VerifiedRequest:
        rid, r, kv = entry.request_id, self.core.requests[entry.request_id], self.kv
        tree = entry.tree
        if tree is None:
            chunk = len(entry.chunk)
            assert entry.chunk_start == r.num_prefilled
            assert 0 < chunk <= len(r.prefill_tokens) - r.num_prefilled
            assert kv is None or kv.cached.get(rid, 0) == r.num_prefilled, f"{rid}: KV out of step"
        else:
            assert tree.root_token == r.all_tokens[-1]
            assert int(tree.depths().max()) <= self.core.max_depth(r)
            assert kv is None or kv.cached.get(rid) == len(r.all_tokens) - 1, (
                f"{rid}: KV out of step"
            )
            chunk = tree.num_nodes
        if kv is not None and not kv.grow(rid, chunk):
            self.oom_errors += 1
            return VerifiedRequest(rid, r.step, error="out_of_kv_memory: fake")
        if tree is None:
            final = entry.chunk_is_last
            bonus = target_next(r.prefill_tokens[-1]) if final else None
            return VerifiedRequest(rid, r.step, bonus=bonus)
        tokens, accepted = verify_tree(tree)
        self.verified.append(tree)
        return VerifiedRequest(rid, r.step, tuple(tokens[:accepted]), tokens[accepted])

    # -- releases and outputs ---------------------------------------------------------------------
    def release(self) -> None:
        route_releases(self.core, self)

    def take_outputs(self, outputs: Sequence[StepOutput]) -> None:
        for out in outputs:
            got = self.streamed.setdefault(out.request_id, [])
            assert out.offset == len(got), f"{out.request_id}: output offset skips or repeats"
            got.extend(out.new_tokens)
            if out.finish_reason is not None:
                self.finish_counts[out.request_id] += 1
                self.finished.append(out)

    # -- one micro-batch --------------------------------------------------------------------------
    def schedule(self) -> bool:
        batch = self.core.next_batch(self.tick(), self.kv)
        if batch is None:
            self.release()
            return False
        self.batches.append(batch)
        preempted = {r.request_id for r in batch.drop + batch.swap_out}
        assert preempted.isdisjoint(r.request_id for r in batch.members + batch.swap_in)
        self.take_outputs(batch.failed)
        self.driver.prepare(batch)  # dropped requests' KV is freed before any swap-in
        for r in batch.decode:  # placed on a drafter, drafted or not
            if r.draft_model is not None and r.drafter is not None:
                self.drafters.last[(r.draft_model, r.drafter, r.request_id)] = "assigned"
        self.plans.append(dict(batch.drafts))
        self.inflight.append(InFlight(batch, self.driver.speculate(batch)))
        return True

    def finish_one(self, index: int = 0) -> list[StepOutput]:
        done = self.inflight.pop(index)
        outputs = self.driver.finish(done.batch, done.results, self.tick())
        for r in done.batch.members:
            rid = r.request_id
            if self.kv is None or rid not in self.core.requests or rid not in self.kv.held:
                continue
            if r.kv == "resident" and not r.is_prefilling and r.prefill_tokens:
                self.kv.trim(rid, len(r.all_tokens) - 1)
        self.take_outputs(outputs)
        return outputs

    def step(self) -> list[StepOutput]:
        """One micro-batch through, the way SpecEngine does it."""
        if not self.schedule():
            return []
        return self.finish_one()

    def run(self, max_iterations: int = 20_000) -> None:
        for _ in range(max_iterations):
            if not self.core.has_unfinished() and not self.inflight:
                return
            if not self.schedule() and self.inflight:
                self.finish_one()
            elif not self.inflight:
                raise AssertionError("the core schedules nothing while requests wait")
            else:
                self.finish_one()
        raise AssertionError("no progress")


def make_core(**config: object) -> SchedulerCore:
    keys = ("chooser", "matcher", "selector", "cost", "policy")
    extra = {k: config.pop(k) for k in keys if k in config}
    fields: dict[str, object] = {"vocab_size": VOCAB, "max_context": 4096}
    return SchedulerCore(CoreConfig(**(fields | config)), **extra)  # type: ignore[arg-type]


def executor(
    core: SchedulerCore, kv: FakeKV | None = None, agree: float = 0.7, seed: int = 0, **kw
) -> FakeExecutor:
    rng = random.Random(seed)
    if not core.drafters:
        core.set_drafters({"d": ["r0", "r1"]})
    return FakeExecutor(core, kv, FakeDrafters(agree, rng), rng, **kw)


def check_releases(ex: FakeExecutor, rids: Sequence[str], *, allow_empty: bool = False) -> None:
    for rid in rids:
        assert ex.finish_counts[rid] == 1, f"{rid} finished {ex.finish_counts[rid]} times"
        assert ex.target_releases_after_finish[rid] == 1, f"{rid}: target released badly"
    assert not ex.drafters.double_releases
    assert not ex.drafters.states, f"draft state left behind: {list(ex.drafters.states)}"
    if not allow_empty:
        assert not ex.drafters.empty_releases
    if ex.kv is not None:
        assert not ex.kv.held and not ex.kv.swapped and not ex.kv.cached


# ---- whole runs with a fake executor -----------------------------------------------------------
def test_a_few_requests_produce_the_target_continuation() -> None:
    core = make_core(token_budget=32)
    ex = executor(core, FakeKV())
    prompts = {"a": 5, "b": 40, "c": 1}
    for rid, n in prompts.items():
        core.add(make_request(rid, n, max_tokens=17))
    ex.run()
    for rid in prompts:
        prompt = make_request(rid, prompts[rid]).prompt
        assert ex.streamed[rid] == greedy(prompt, 17)
    check_releases(ex, list(prompts))
    assert sum(len(p) for p in ex.plans) > 0  # it did speculate


METHODS = [
    DraftMethod("chain", k=4),
    DraftMethod("static", expansion=(2, 2, 1)),
    DraftMethod("beam", depth=3, width=2),
    DraftMethod("dynamic", budget=12, max_size=6, max_depth=4, max_width=2),
]


def cost_model(
    verify: Sequence[tuple[int, float]], draft: Sequence[tuple[int, float]] = ((1, 0.5), (64, 0.6))
) -> CostModel:
    """A synthetic cost model: (tokens, ms) points of the verifier's and draft "d"'s forwards."""
    key = ProfileKey(model="t", fingerprint="f", device="cpu: fake", dtype="float32", threads=1)

    def curve(points: Sequence[tuple[int, float]]) -> ForwardCurve:
        return ForwardCurve(
            tokens=[n for n, _ in points], contexts=[0], ms_grid=[[ms] for _, ms in points]
        )

    return CostModel(
        CostProfile(
            target=ModelProfile(key=key, curve=curve(verify)),
            drafts={
                "d": ModelProfile(key=key.model_copy(update={"model": "d"}), curve=curve(draft))
            },
        )
    )


def flat_cost() -> CostModel:
    return cost_model(verify=[(1, 10.0), (64, 16.3)], draft=[(1, 0.5), (64, 0.6)])


@st.composite
def workloads(draw: st.DrawFn, pressure: bool = False) -> dict:
    """Requests arriving over time and a core configuration; `pressure`: many long requests
    in a small cache, so that requests are preempted (each still fits alone)."""
    n = draw(st.integers(4, 8) if pressure else st.integers(1, 7))
    prompt_sizes = (10, 30) if pressure else (1, 30)
    reqs = []
    for i in range(n):
        reqs.append(
            dict(
                rid=f"r{i}",
                prompt=draw(
                    st.lists(
                        st.integers(0, VOCAB - 1),
                        min_size=prompt_sizes[0],
                        max_size=prompt_sizes[1],
                    )
                ),
                max_tokens=draw(st.integers(8 if pressure else 1, 24)),
                arrival=draw(st.integers(0, 12)),
                priority=draw(st.sampled_from([0, 0, 0, 1, -1])),
                speculate=draw(st.booleans()) or draw(st.booleans()),
                stop=draw(st.sampled_from([(), (), (5,)])),
            )
        )
    cancels = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 60)), max_size=2))
    # a request alone needs at most (30 + 24 + 1 + 10) / 4 = 17 blocks of 4 tokens
    blocks = [17, 18, 20, 24] if pressure else [None, 10_000, 30, 20, 17]
    return dict(
        requests=reqs,
        cancels=cancels,
        micro_batches=draw(st.integers(1, 3)),
        budget=draw(st.integers(8, 64)),
        max_running=draw(st.sampled_from([2, 4, 64] if pressure else [1, 2, 4, 64])),
        method=draw(st.sampled_from(METHODS)),
        agree=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])),
        blocks=draw(st.sampled_from(blocks)),
        can_swap=draw(st.booleans()),
        # the preempting policies park, swap and recompute; FCFS only ever preempts for memory
        policy=draw(st.sampled_from(["fcfs", "fcfs", "las", "lp-sjf", "laps-sd"])),
        draft_failure=draw(st.sampled_from([0.0, 0.0, 0.2])),
        goodput=draw(st.booleans()),
        replica_change=draw(st.integers(-1, 40)),
        seed=draw(st.integers(0, 2**16)),
    )


def expected_output(prompt: Sequence[int], max_tokens: int, stop: Sequence[int]) -> list[int]:
    out = []
    for t in greedy(prompt, max_tokens):
        if t in stop:
            break
        out.append(t)
    return out


class PrefillDeadlock(AssertionError):
    """Nothing scheduled while every running request holds a partial prefill: see
    test_partial_prefills_do_not_deadlock_when_policy_and_admission_orders_differ."""


def is_prefill_deadlock(core: SchedulerCore, kv: FakeKV | None) -> bool:
    """Nothing scheduled while every running request is a partial prefill."""
    if kv is None or len(core.running) < 2:
        return False
    return all(r.is_prefilling and r.num_prefilled > 0 for r in core.running)


def simulate(w: dict) -> tuple[FakeExecutor, dict[str, RequestState]]:
    method = w["method"]
    core = make_core(
        token_budget=w["budget"],
        micro_batches=w["micro_batches"],
        max_running=w["max_running"],
        method=method,
        max_context=64,
        cost=flat_cost() if w["goodput"] else None,
        policy=make_policy(w.get("policy", "fcfs"), "oracle"),
    )
    kv = FakeKV(w["blocks"], can_swap=w["can_swap"]) if w["blocks"] is not None else None
    ex = executor(core, kv, w["agree"], w["seed"], draft_failure=w["draft_failure"])
    rng = ex.rng
    arrivals = sorted(w["requests"], key=lambda r: r["arrival"])
    cancels = sorted(w["cancels"], key=lambda c: c[1])
    states: dict[str, RequestState] = {}
    tick = 0
    for _ in range(20_000):
        while arrivals and arrivals[0]["arrival"] <= tick:
            spec = arrivals.pop(0)
            r = make_request(
                spec["rid"], spec["prompt"], spec["max_tokens"], stop_token_ids=spec["stop"]
            )
            r.priority, r.speculate = spec["priority"], spec["speculate"]
            core.add(r)
            states[r.request_id] = r
        while cancels and cancels[0][1] <= tick:
            index, _ = cancels.pop(0)
            rid = w["requests"][index]["rid"]
            known = rid in core.requests
            assert core.cancel(rid) == known
            if known and rid not in core.requests:  # idle: finished at once, no output
                assert states[rid].finish_reason == "abort"
                ex.finish_counts[rid] += 1
            ex.release()
        if tick == w["replica_change"]:
            core.set_drafters({"d": ["r1", "r2"]})
        tick += 1
        if not core.has_unfinished() and not ex.inflight:
            if not arrivals:
                break
            continue
        # several micro-batches in flight; they come back in any order
        if len(ex.inflight) < w["micro_batches"] and rng.random() < 0.7 and ex.schedule():
            continue
        if ex.inflight:
            ex.finish_one(rng.randrange(len(ex.inflight)))
        elif core.has_unfinished() and not ex.schedule():
            if is_prefill_deadlock(core, kv):
                raise PrefillDeadlock
            raise AssertionError("nothing in flight and the core schedules nothing")
    else:
        raise AssertionError("no progress")
    return ex, states


def check_run(w: dict) -> tuple[FakeExecutor, dict[str, RequestState]]:
    ex, states = simulate(w)
    cancelled = {w["requests"][i]["rid"] for i, _ in w["cancels"]}
    for spec in w["requests"]:
        rid = spec["rid"]
        request = states[rid]
        want = expected_output(spec["prompt"], spec["max_tokens"], spec["stop"])
        got = ex.streamed.get(rid, [])
        assert got == request.output
        if rid in cancelled and request.finish_reason == "abort":
            assert want[: len(got)] == got
        else:
            assert request.finish_reason in ("stop", "length"), request.error
            assert got == want
            assert request.finish_reason == (
                "length" if len(want) == spec["max_tokens"] else "stop"
            )
    check_releases(ex, [s["rid"] for s in w["requests"]], allow_empty=w["goodput"])
    assert not ex.core.requests and not ex.core.running and not ex.core.waiting
    assert ex.oom_errors == 0  # the core's block accounting matches the cache's
    return ex, states


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_request_gets_exactly_the_target_continuation(w: dict) -> None:
    check_run(w)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(pressure=True))
def test_preemption_under_pressure_keeps_outputs_exact(w: dict) -> None:
    check_run(w)


def test_fcfs_completes_equal_work_in_arrival_order() -> None:
    for micro_batches, max_running in [(1, 1), (1, 2), (2, 2), (3, 64)]:
        core = make_core(token_budget=8, micro_batches=micro_batches, max_running=max_running)
        ex = executor(core, FakeKV(), agree=1.0)
        rids = [f"q{i}" for i in range(6)]
        for rid in rids:
            core.add(make_request(rid, [3, 4, 5, 6], max_tokens=10))
        while core.has_unfinished() or ex.inflight:
            while len(ex.inflight) < micro_batches and ex.schedule():
                pass
            ex.finish_one()  # oldest first
        assert [o.request_id for o in ex.finished] == rids, (micro_batches, max_running)
        check_releases(ex, rids)


def test_fcfs_priority_first() -> None:
    core = make_core(token_budget=8, max_running=1)
    ex = executor(core, FakeKV())
    for rid, priority in [("a", 0), ("b", 1), ("c", -1), ("d", 0)]:
        r = make_request(rid, 4, max_tokens=5)
        r.priority = priority
        core.add(r)
    ex.run()
    assert [o.request_id for o in ex.finished] == ["c", "a", "d", "b"]


@pytest.mark.parametrize("can_swap", [True, False])
def test_few_blocks_force_preemption_and_outputs_stay_exact(can_swap: bool) -> None:
    core = make_core(token_budget=16, method=DraftMethod("chain", k=3))
    kv = FakeKV(num_blocks=12, block_size=4, can_swap=can_swap)
    ex = executor(core, kv, agree=0.8)
    prompts = {f"p{i}": [i + 1] * (6 + i) for i in range(5)}
    for rid, prompt in prompts.items():
        core.add(make_request(rid, prompt, max_tokens=22))
    ex.run()
    for rid, prompt in prompts.items():
        assert ex.streamed[rid] == greedy(prompt, 22)
    preempted = [b for b in ex.batches if b.swap_out or b.drop]
    assert preempted, "the cache was never full"
    if can_swap:
        assert any(b.swap_out for b in ex.batches) and any(b.swap_in for b in ex.batches)
    else:
        assert not any(b.swap_out for b in ex.batches) and any(b.drop for b in ex.batches)
    check_releases(ex, list(prompts))
    assert ex.oom_errors == 0


def test_out_of_kv_from_the_verifier_means_recompute() -> None:
    core = make_core(token_budget=32)
    ex = executor(core, FakeKV())
    core.add(make_request("a", 6, max_tokens=12))
    core.add(make_request("b", 6, max_tokens=12))
    ex.step()  # both prefill
    batch = core.next_batch(ex.tick(), ex.kv)
    assert batch is not None and [r.request_id for r in batch.decode] == ["a", "b"]
    a = core.requests["a"]
    had = list(a.output)
    results = {
        "a": StepResult("a", a.step, error="out_of_kv_memory: no room"),
        "b": StepResult("b", core.requests["b"].step, [target_next(core.requests["b"].output[-1])]),
    }
    ex.take_outputs(core.observe(batch, results, ex.tick()))
    releases = core.take_releases()
    assert [(r.request_id, r.target) for r in releases if r.target] == [("a", True)]
    assert a.kv == "dropped" and a.prefill_tokens == a.prompt + had and a in core.waiting
    core.add(make_request("c", 3, max_tokens=4))
    batch = core.next_batch(ex.tick(), None)  # the verifier was full: admit nobody new
    assert batch is not None and {r.request_id for r in batch.members} == {"b"}


def test_a_request_alone_and_too_big_for_the_cache_fails() -> None:
    core = make_core(token_budget=32, method=None)
    kv = FakeKV(num_blocks=2, block_size=4)
    ex = executor(core, kv)
    core.add(make_request("big", 7, max_tokens=4))  # the prompt fits, the output does not
    ex.run()
    (out,) = ex.finished
    assert out.finish_reason == "error" and "KV" in (out.error or "")
    assert ex.streamed["big"] == greedy(core_prompt("big", 7), 2)
    check_releases(ex, ["big"])


# ---- batching -----------------------------------------------------------------------------------
def decoding_core(n: int, **config: object) -> tuple[SchedulerCore, FakeExecutor]:
    core = make_core(**config)
    ex = executor(core, FakeKV())
    for i in range(n):
        core.add(make_request(f"r{i}", 4, max_tokens=500))
    while any(r.is_prefilling or r in core.waiting for r in core.requests.values()):
        assert ex.schedule()  # every micro-batch in flight at once, then all back
        while ex.schedule():
            pass
        while ex.inflight:
            ex.finish_one()
    return core, ex


def test_micro_batches_split_the_running_set() -> None:
    core, _ = decoding_core(8, micro_batches=2, token_budget=512)
    first = core.next_batch(1.0)
    assert first is not None and len(first.decode) == 4 and not first.prefill
    second = core.next_batch(2.0)
    assert second is not None and len(second.decode) == 4
    assert {r.request_id for r in second.decode}.isdisjoint(r.request_id for r in first.decode)
    assert core.next_batch(3.0) is None  # everyone is in flight


def test_admission_chunks_prompts_within_the_token_budget() -> None:
    core = make_core(token_budget=256, max_context=1024)
    core.add(make_request("long", 300, max_tokens=10))
    core.add(make_request("short", 10, max_tokens=10))
    batch = core.next_batch(0.0)
    assert batch is not None
    assert [(r.request_id, n) for r, n in batch.prefill] == [("long", 256)]
    assert batch.prefill_tokens == 256 and [r.request_id for r in core.waiting] == ["short"]
    core.observe(batch, {"long": StepResult("long", 0)}, 1.0)
    batch = core.next_batch(2.0)  # the rest of the long prompt, then the short one
    assert batch is not None
    assert [(r.request_id, n) for r, n in batch.prefill] == [("long", 44), ("short", 10)]
    # at the running-set limit nobody is admitted
    limited, _ = decoding_core(1, max_running=1, token_budget=256)
    limited.add(make_request("late", 5))
    batch = limited.next_batch(0.0)
    assert batch is not None and not batch.prefill and len(batch.decode) == 1


def test_trees_and_chunks_share_the_budget() -> None:
    core, ex = decoding_core(3, token_budget=12, method=DraftMethod("chain", k=4))
    core.add(make_request("new", 30, max_tokens=5))
    batch = core.next_batch(ex.tick())
    assert batch is not None and len(batch.decode) == 3
    # the trees may use at most half the budget while a prompt waits
    assert batch.prefill_tokens == 12 - 6
    drafted = {rid: ex.drafters.draft(p, core.requests[rid]) for rid, p in batch.drafts.items()}
    trees = core.select_trees(batch, drafted, ex.tick())
    assert sum(t.num_nodes for t in trees.values()) <= 12 - batch.prefill_tokens


def test_tree_sizes() -> None:
    assert DraftMethod("chain", k=4).max_draft_tokens == 4
    static = DraftMethod("static", expansion=(2, 2, 1))
    assert static.max_draft_tokens == 2 + 4 + 4
    assert [static.tokens_at_depth(d) for d in range(5)] == [0, 2, 4, 4, 0]
    beam = DraftMethod("beam", depth=3, width=2)
    assert beam.max_draft_tokens == 6 and beam.tokens_at_depth(3) == 2
    dynamic = DraftMethod("dynamic", budget=12, max_size=12, max_depth=5, max_width=3)
    assert dynamic.max_draft_tokens == 12 and dynamic.tokens_at_depth(5) == 3
    assert dynamic.tokens_at_depth(6) == 0
    assert dynamic.for_batch(4).budget == 48 and dynamic.for_batch(0).budget == 12
    assert beam.for_batch(4) is beam
    assert tree_capacity(None) == 1 and tree_capacity(static) == 11
    for m in METHODS:
        assert tree_capacity(m) == 1 + m.max_draft_tokens
        assert sum(m.tokens_at_depth(d) for d in range(1, m.num_layers + 1)) >= m.max_draft_tokens


def test_plans_follow_the_method_and_the_tokens_left() -> None:
    core, ex = decoding_core(2, method=DraftMethod("static", expansion=(2, 2, 1)))
    short = core.requests["r1"]
    short.params = SamplingParams(max_tokens=len(short.output) + 2)  # two tokens left
    batch = core.next_batch(ex.tick())
    assert batch is not None
    plan = batch.drafts["r0"]
    assert (plan.max_depth, plan.max_nodes, plan.base_len) == (3, 10, 0)
    assert plan.new_tokens == tuple(core.requests["r0"].all_tokens)
    assert batch.drafts["r1"].max_depth == 1 and batch.drafts["r1"].max_nodes == 2


def test_requests_without_speculation_are_not_drafted() -> None:
    core = make_core(token_budget=64)
    ex = executor(core, FakeKV())
    plain = make_request("plain", 4, max_tokens=12)
    plain.speculate = False
    core.add(plain)
    core.add(make_request("spec", 4, max_tokens=12))
    ex.run()
    assert all("plain" not in plans for plans in ex.plans)
    assert any("spec" in plans for plans in ex.plans)
    assert ex.streamed["plain"] == greedy(plain.prompt, 12)
    assert plain.stats.num_draft_tokens == 0 and plain.draft_model is None


# ---- checks, cancels ----------------------------------------------------------------------------
def test_check_refuses_bad_requests() -> None:
    core = make_core(max_context=32)
    with pytest.raises(InvalidRequestError, match="empty"):
        core.check([], 4)
    with pytest.raises(InvalidRequestError, match="out of range"):
        core.check([VOCAB], 4)
    with pytest.raises(ContextLengthError):
        core.check([1] * 30, 3)
    core.add(make_request("x", 3, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="in use"):
        core.add(make_request("x", 3, max_tokens=4))
    assert not core.cancel("nobody")


def test_cancel_in_flight_finishes_when_the_batch_returns() -> None:
    core = make_core()
    ex = executor(core, FakeKV())
    core.add(make_request("a", 4, max_tokens=30))
    ex.step()
    ex.step()
    assert ex.schedule()
    assert core.cancel("a")
    assert "a" in core.requests and not core.take_releases()  # still in flight
    (out,) = ex.finish_one()
    assert out.finish_reason == "abort" and out.new_tokens == []
    assert "a" not in core.requests
    check_releases(ex, ["a"])


# ---- stops --------------------------------------------------------------------------------------
def test_stop_tokens_end_the_request_without_being_emitted() -> None:
    r = make_request("s", max_tokens=10, stop_token_ids=(7,))
    assert append_tokens(r, [3, 4, 7, 5], eos_token_ids=()) == [3, 4]
    assert r.finish_reason == "stop"
    eos = make_request("e", max_tokens=10)
    assert append_tokens(eos, [3, 2], eos_token_ids=(2,)) == [3]
    ignoring = make_request("i", max_tokens=3, ignore_eos=True)
    assert append_tokens(ignoring, [2, 2, 2, 2], eos_token_ids=(2,)) == [2, 2, 2]
    assert ignoring.finish_reason == "length"


def test_eos_through_the_core() -> None:
    prompt = [1, 2]
    cont = greedy(prompt, 10)
    core = make_core(eos_token_ids=(cont[4],))
    ex = executor(core, FakeKV(), agree=1.0)
    core.add(make_request("e", prompt, max_tokens=10))
    ex.run()
    assert ex.streamed["e"] == cont[:4] and ex.finished[0].finish_reason == "stop"


# ---- tree selection -----------------------------------------------------------------------------
def selection(budget: int, max_depth: Mapping[str, int] | None = None) -> SelectionContext:
    return SelectionContext(
        requests={},
        budget=budget,
        prefill_tokens=0,
        max_depth=max_depth or {},
        calibration={},
        cost=None,
        context=0,
        now=0.0,
    )


def test_global_greedy_takes_the_most_probable_nodes_across_requests() -> None:
    a = TokenTree.chain(1, [2, 3, 4], np.log([0.9, 0.9, 0.9]).tolist())  # f: .9 .81 .73
    b = TokenTree.chain(5, [6, 7], np.log([0.5, 0.5]).tolist())  # f: .5 .25
    picked = GlobalGreedy().select({"a": a, "b": b}, selection(6))
    assert picked["a"].tokens.tolist() == [1, 2, 3, 4]
    assert picked["b"].tokens.tolist() == [5, 6]
    tight = GlobalGreedy().select({"a": a, "b": b}, selection(2))
    assert [t.num_nodes for t in tight.values()] == [1, 1]  # roots always, nothing else


def test_global_greedy_respects_depth_limits_and_keeps_parents() -> None:
    tree = TokenTree.build(
        [1, 2, 3, 4, 5], [-1, 0, 0, 1, 3], np.log([1, 0.6, 0.4, 0.5, 0.9]).tolist()
    )
    picked = GlobalGreedy().select({"r": tree}, selection(10, {"r": 2}))
    assert picked["r"].tokens.tolist() == [1, 2, 3, 4]
    parents = picked["r"].parents
    assert all(parents[i] < i for i in range(1, len(parents)))


def test_sampled_siblings_are_taken_in_draw_order() -> None:
    """Which sampled children stay must not depend on their own tokens (lossless sampling)."""
    proposal = SparseDist(ids=np.array([7, 8]), probs=np.array([0.5, 0.5]))
    tree = TokenTree.build(
        [1, 7, 8, 7],
        [-1, 0, 0, 0],
        [0.0, np.log(0.1), np.log(0.9), np.log(0.1)],
        [-1, 0, 0, 0],
        [proposal],
    )
    picked = GlobalGreedy().select({"r": tree}, selection(3))
    assert picked["r"].tokens.tolist() == [1, 7, 8]  # the first two draws, not the likeliest


def test_unknown_names_are_refused() -> None:
    assert isinstance(make_policy("fcfs"), FCFS)
    assert isinstance(make_selector("global-greedy"), GlobalGreedy)
    assert isinstance(make_chooser("fixed", ["a"]), FixedDraftModel)
    assert isinstance(make_matcher("least-loaded"), LeastLoadedSticky)
    for make in (make_policy, make_selector, make_matcher):
        with pytest.raises(ValueError, match="unknown"):
            make("nope")  # type: ignore[operator]
    with pytest.raises(ValueError, match="unknown"):
        make_chooser("nope", [])


# ---- ordering -----------------------------------------------------------------------------------
def test_fcfs_orders_by_priority_then_arrival() -> None:
    core = make_core()
    a, b, c = make_request("a"), make_request("b"), make_request("c")
    for r in (a, b, c):
        core.add(r)
    c.priority = -1
    ctx = PolicyContext(0.0, None, 64)
    assert [r.request_id for r in FCFS().order([b, a, c], ctx)] == ["c", "a", "b"]
    assert FCFS().preempt([a, b], [c], ctx) == []


# ---- draft models and replicas ------------------------------------------------------------------
def test_replicas_are_sticky_and_least_loaded() -> None:
    m = LeastLoadedSticky()
    placed = [m.place(f"r{i}", None, ["b0", "b1"]) for i in range(4)]
    assert placed == ["b0", "b1", "b0", "b1"]
    assert m.place("r0", "b0", ["b0", "b1"]) == "b0"  # sticky
    assert m.load() == {"b0": 2, "b1": 2}
    assert m.place("r0", "b0", ["b1"]) == "b1"  # b0 died
    assert m.load() == {"b0": 1, "b1": 3}
    m.release("r1")
    m.release("r1")  # twice: no harm
    assert m.load() == {"b0": 1, "b1": 2}
    assert m.place("new", None, ["b0", "b1"]) == "b0"


def test_the_core_places_drafts_on_sticky_least_loaded_replicas() -> None:
    core, ex = decoding_core(4, chooser=FixedDraftModel(["big"]))
    core.set_drafters({"small": ["s0"], "big": ["b0", "b1"]})
    asked = make_request("asked", 4, max_tokens=500)
    asked.requested_draft = "small"
    core.add(asked)
    batch = core.next_batch(ex.tick(), ex.kv)
    assert batch is not None
    assert [(batch.drafts[f"r{i}"].model, batch.drafts[f"r{i}"].replica) for i in range(4)] == [
        ("big", "b0"),
        ("big", "b1"),
        ("big", "b0"),
        ("big", "b1"),
    ]
    ex.plans.append(batch.drafts)
    drafted = {rid: ex.drafters.draft(p, core.requests[rid]) for rid, p in batch.drafts.items()}
    for rid in drafted:
        core.note_drafted(rid, True)
    trees = core.select_trees(batch, drafted, ex.tick())
    results = {}
    for r in batch.members:
        if r in batch.decode:
            tokens, accepted = verify_tree(trees[r.request_id])
            results[r.request_id] = StepResult(r.request_id, r.step, tokens, accepted)
        else:
            tokens = [target_next(r.prompt[-1])]
            results[r.request_id] = StepResult(r.request_id, r.step, tokens)
    core.observe(batch, results, ex.tick())
    r0 = core.requests["r0"]
    seen = r0.num_seen_by_drafter
    batch = core.next_batch(ex.tick(), ex.kv)
    assert batch is not None
    plan = batch.drafts["r0"]
    assert (plan.replica, plan.base_len) == ("b0", seen)  # sticky: its draft KV is warm
    assert batch.drafts["asked"].model == "small" and batch.drafts["asked"].replica == "s0"
    core.observe(batch, {}, ex.tick())  # out of sync: everyone recomputes
    core.take_releases()
    core.set_drafters({"small": ["s0"], "big": ["b1"]})  # b0 died
    while core.requests["r0"].is_prefilling or core.requests["r0"] in core.waiting:
        b = core.next_batch(ex.tick(), None)
        assert b is not None
        res = {
            r.request_id: StepResult(
                r.request_id,
                r.step,
                [target_next(r.prefill_tokens[-1])]
                if r.num_prefilled + n == len(r.prefill_tokens)
                else [],
            )
            for r, n in b.prefill
        }
        core.observe(b, res, ex.tick())
    batch = core.next_batch(ex.tick(), None)
    assert batch is not None
    assert batch.drafts["r0"].replica == "b1" and batch.drafts["r0"].base_len == 0
    core.set_drafters({})
    for r in list(core.requests.values()):
        r.in_flight = False
    batch = core.next_batch(ex.tick(), None)
    assert batch is not None and batch.decode and not batch.drafts


def test_a_dead_replica_releases_its_draft_state() -> None:
    core = make_core()
    core.set_drafters({"d": ["x0", "x1"]})
    ex = FakeExecutor(core, FakeKV(), FakeDrafters(0.8, random.Random(0)), random.Random(0))
    core.add(make_request("a", 4, max_tokens=40))
    for _ in range(4):
        ex.step()
    assert core.requests["a"].drafter == "x0"
    core.set_drafters({"d": ["x1"]})
    ex.step()
    assert core.requests["a"].drafter == "x1"
    assert ("d", "x0", "a") not in ex.drafters.states
    ex.run()
    assert ex.streamed["a"] == greedy(core_prompt("a", 4), 40)
    check_releases(ex, ["a"])


def core_prompt(rid: str, n: int) -> list[int]:
    return make_request(rid, n).prompt


def test_partial_prefills_do_not_deadlock_the_cache() -> None:
    core = make_core(token_budget=8, micro_batches=2, method=None)
    kv = FakeKV(num_blocks=8, block_size=4)  # 32 tokens: each request fits alone
    ex = executor(core, kv)
    core.add(make_request("a", 24, max_tokens=4))
    core.add(make_request("b", 24, max_tokens=4))
    for _ in range(2):
        assert ex.schedule() and ex.schedule()  # a's chunk and b's chunk in flight together
        ex.finish_one()
        ex.finish_one()
    assert kv.num_free_blocks() == 0 and all(r.is_prefilling for r in core.running)
    ex.run()
    assert ex.streamed["a"] == greedy(core_prompt("a", 24), 4)
    assert ex.streamed["b"] == greedy(core_prompt("b", 24), 4)


def test_probes_stay_within_the_token_budget() -> None:
    """A probe forced into the verified trees used to push the forward past the budget."""

    def spec(rid: str, prompt: list[int], max_tokens: int, speculate: bool) -> dict:
        return dict(
            rid=rid,
            prompt=prompt,
            max_tokens=max_tokens,
            arrival=0,
            priority=0,
            speculate=speculate,
            stop=(),
        )

    check_run(
        dict(
            requests=[
                spec("r0", [0], 1, False),
                spec("r1", [0], 9, True),
                spec("r2", [0], 6, True),
                spec("r3", [0], 6, True),
                spec("r4", [0] * 15, 1, False),
            ],
            cancels=[],
            micro_batches=1,
            budget=8,
            max_running=4,
            method=DraftMethod("chain", k=4),
            agree=0.9,
            blocks=None,
            can_swap=False,
            draft_failure=0.0,
            goodput=True,
            replica_change=0,
            seed=0,
        )
    )


def test_a_request_preempted_for_an_older_chunk_is_not_readmitted_at_once() -> None:
    """It used to be dropped and prefilled again in the same micro-batch, its blocks counted
    from the cache's stale state (the verifier then ran out of blocks)."""

    def spec(rid: str, n: int, arrival: int, speculate: bool) -> dict:
        return dict(
            rid=rid,
            prompt=[0] * n,
            max_tokens=8,
            arrival=arrival,
            priority=0,
            speculate=speculate,
            stop=(),
        )

    check_run(
        dict(
            requests=[
                spec("r0", 12, 3, True),
                spec("r1", 10, 0, True),
                spec("r2", 29, 2, True),
                spec("r3", 10, 3, False),
                spec("r4", 10, 3, False),
                spec("r5", 10, 3, False),
            ],
            cancels=[],
            micro_batches=2,
            budget=16,
            max_running=4,
            method=DraftMethod("chain", k=4),
            agree=0.9,
            blocks=18,
            can_swap=False,
            draft_failure=0.2,
            goodput=True,
            replica_change=0,
            seed=1640,
        )
    )


def test_partial_prefills_do_not_deadlock_when_policy_and_admission_orders_differ() -> None:
    core = make_core(token_budget=8, micro_batches=2, method=None)
    kv = FakeKV(num_blocks=8, block_size=4)  # 32 tokens: each request fits alone
    ex = executor(core, kv)
    late = make_request("a", 24, max_tokens=4)
    late.priority = 1
    core.add(late)
    assert ex.schedule()  # a's first chunk
    core.add(make_request("b", 24, max_tokens=4))  # b comes first by priority ...
    assert ex.schedule()  # ... but is admitted after a
    for _ in range(2):
        ex.finish_one()
    assert ex.schedule() and ex.schedule()  # b's chunk and a's chunk in flight together
    for _ in range(2):
        ex.finish_one()
    assert kv.num_free_blocks() == 0 and all(r.is_prefilling for r in core.running)
    ex.run()
    assert ex.streamed["a"] == greedy(core_prompt("a", 24), 4)
    assert ex.streamed["b"] == greedy(core_prompt("b", 24), 4)
