"""LAPS-SD and its baselines (LAS, LP-SJF) as policies of the scheduler core: queues, demotion,
stabilization, ordering, Eq. 6, who may be preempted, and that preemption never changes what
greedy decoding outputs."""

from __future__ import annotations

import pytest

from shared.scheduling.factory import make_policy
from shared.scheduling.laps import LAPSSD, LAS, LPSJF, OracleLength
from shared.scheduling.ordering import PolicyContext
from shared.scheduling.request import RequestState
from shared.settings import LapsSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.test_engine_greedy import make_engine
from tests.test_scheduler_core import (
    FakeKV,
    check_releases,
    core_prompt,
    cost_model,
    executor,
    greedy,
    make_core,
    make_request,
)

CTX = PolicyContext(now=0.0, cost=None, max_running=2)
PARAMS = LapsSettings(
    num_queues=3, first_threshold_ms=100, threshold_base=4, stable_rounds=3, stable_delta=0.05
)


def laps() -> LAPSSD:
    return LAPSSD(OracleLength(), PARAMS)


def decoded(rid: str, *, service_ms: float = 0, max_tokens: int = 50, arrival: int = 0):
    request = make_request(rid, max_tokens=max_tokens)
    request.attained_service_ms = service_ms
    request.arrival = arrival
    request.num_prefilled = len(request.prefill_tokens)
    request.output = [1]  # past its prefill
    return request


def step(request: RequestState, drafted: int, accepted: int, seen_by: LAPSSD | None = None):
    """One decode step as the core records it; the policy sees every step (as it orders the
    requests for each micro-batch)."""
    request.step += 1
    request.output.append(1)
    request.record_step(drafted, accepted, "d")
    if seen_by is not None:
        seen_by.acceptance(request)


def test_queues_follow_attained_service_with_exponential_thresholds() -> None:
    policy = laps()  # thresholds 100, 400 ms; three queues
    assert [policy.queue(decoded("a", service_ms=ms)) for ms in (0, 99, 100, 399, 400, 10**6)] == [
        1, 1, 2, 2, 3, 3,
    ]  # fmt: skip
    request = decoded("r")
    assert policy.queue(request) == 1  # a new request starts in Q1
    request.attained_service_ms = 150
    assert policy.queue(request) == 2  # demoted as its service passes the threshold


def test_a_request_becomes_perceptible_once_its_rate_is_stable() -> None:
    policy = laps()
    request = decoded("r")
    for drafted, accepted in [(4, 0), (4, 4), (4, 2)]:  # cumulative 0, 0.5, 0.5
        step(request, drafted, accepted)
        assert policy.acceptance(request) is None
    for _ in range(3):  # 0.5, 0.5, 0.5 after the swing has left the window
        step(request, 4, 2)
        policy.acceptance(request)
    assert policy.acceptance(request) == pytest.approx(0.5)
    policy.acceptance(request)  # asking again in the same step samples nothing new
    step(request, 4, 0)  # perceptible stays perceptible
    assert policy.acceptance(request) == pytest.approx(0.5)


def test_eq6_estimates_the_remaining_time() -> None:
    # verify 10 ms a forward, draft 0.5 ms a token (flat curves); n = 4 drafted, A = 0.5:
    # a step commits 3 tokens; 60 tokens left: 20 steps of 4 * 0.5 + 10 ms = 240 ms
    ctx = PolicyContext(0.0, cost_model([(1, 10.0), (64, 10.0)], [(1, 0.5), (64, 0.5)]), 2)
    policy = laps()
    request = decoded("r", max_tokens=61)
    for _ in range(4):
        step(request, 4, 2, policy)
    request.draft_model = "d"
    remaining = 61 - len(request.output)
    n, a = 4, 0.5
    want = n * remaining * 0.5 / (n * a + 1) + remaining * 10.0 / (n * a + 1)
    assert policy.estimated_ms(request, 0.5, ctx) == pytest.approx(want)
    # a tree: 4 tokens in 2 layers a step cost 2 draft forwards (of 2 tokens each), not 4
    tree = decoded("t", max_tokens=61)
    for _ in range(4):
        tree.step += 1
        tree.output.append(1)
        tree.record_step(4, 2, "d", depth=2)
    tree.draft_model = "d"
    steps = remaining / (n * a + 1)
    assert policy.estimated_ms(tree, 0.5, ctx) == pytest.approx(steps * (2 * 0.5 + 10.0))


def test_perceptible_first_and_shortest_first_within_a_queue() -> None:
    policy = laps()
    early = decoded("early", arrival=0)  # non-perceptible, first to arrive
    long_, short = decoded("long", max_tokens=500, arrival=1), decoded("short", arrival=2)
    for request in (long_, short):
        for _ in range(3):
            step(request, 4, 2, policy)
    later_queue = decoded("served", service_ms=1000, arrival=3)
    order = policy.order([later_queue, early, long_, short], CTX)
    assert [r.request_id for r in order] == ["short", "long", "early", "served"]


def test_a_perceptible_request_yields_once_as_it_moves_then_is_never_preempted() -> None:
    policy = laps()
    ctx = PolicyContext(0.0, None, max_running=1)

    def perceptible(rid: str) -> RequestState:
        request = decoded(rid, service_ms=1000)
        for _ in range(3):
            step(request, 4, 2, policy)
        assert policy.acceptance(request) is not None
        return request

    moving = perceptible("moving")  # just stable: it takes its place in the order once
    assert policy.preempt([moving], [decoded("w1", arrival=2)], ctx) == [moving]
    committed = perceptible("committed")
    assert policy.preempt([committed], [], ctx) == []  # it runs on as a perceptible request
    for newcomer in (decoded("w2", arrival=3), decoded("w3", arrival=4)):
        assert policy.order([committed, newcomer], ctx)[0] is newcomer  # Q1 ranks first ...
        assert policy.preempt([committed], [newcomer], ctx) == []  # ... but it is never preempted
    fresh = decoded("fresh", service_ms=1000, arrival=1)  # non-perceptible: preempted (LAS-like)
    assert policy.preempt([fresh], [decoded("w4", arrival=5)], ctx) == [fresh]


def test_a_perceptible_request_moves_to_the_queue_of_its_expected_service() -> None:
    # verify 10 ms a step (no draft model is placed: no draft cost); 4 drafted, A = 0.5: 3 tokens
    ctx = PolicyContext(0.0, cost_model([(1, 10.0), (64, 10.0)], [(1, 0.5), (64, 0.5)]), 1)
    policy = laps()  # thresholds 100, 400 ms
    short, long_ = decoded("short", max_tokens=20), decoded("long", max_tokens=200)
    for request in (short, long_):
        for _ in range(3):
            step(request, 4, 2, policy)
    assert policy.queue(short) == policy.queue(long_) == 1  # attained service: none yet
    assert policy.queue(short, ctx) == 1  # 16 tokens left: 5.3 steps, 53 ms in all
    assert policy.queue(long_, ctx) == 3  # 196 tokens left: 65.3 steps, 653 ms
    fresh = decoded("fresh", arrival=9)
    assert [r.request_id for r in policy.order([long_, fresh, short], ctx)] == [
        "short", "fresh", "long",
    ]  # fmt: skip


def test_las_preempts_for_less_attained_service_and_lp_sjf_never() -> None:
    old, new = decoded("old", service_ms=500), decoded("new", service_ms=0)
    assert LAS().preempt([old], [new], PolicyContext(0.0, None, 1)) == [old]
    assert LAS().preempt([new], [old], PolicyContext(0.0, None, 1)) == []
    sjf = LPSJF(OracleLength())
    long_, short = decoded("long", max_tokens=400), decoded("short", max_tokens=20)
    assert [r.request_id for r in sjf.order([long_, short], CTX)] == ["short", "long"]
    assert sjf.preempt([long_], [short], PolicyContext(0.0, None, 1)) == []


def test_policies_that_need_lengths_use_the_learned_predictor_by_default() -> None:
    for name in ("lp-sjf", "laps-sd"):
        policy = make_policy(name)
        assert isinstance(policy, LPSJF | LAPSSD) and policy.predictor.name == "learned"
        assert make_policy(name, "oracle").predictor.name == "oracle"  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="unknown output-length predictor"):
            make_policy(name, "psychic")
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_policy("sjf")


PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 4  # bytes of one 4-token KV block of the tiny target


@pytest.mark.parametrize("policy", ["fcfs", "las", "lp-sjf", "laps-sd"])
@pytest.mark.parametrize(("kv_blocks", "kind"), [(512, "kept"), (8, "swapped")])
def test_greedy_output_is_unchanged_by_preemption(
    tiny_target_dir, tiny_draft_dir, policy, kv_blocks, kind
) -> None:
    # two running slots for five requests: LAS (and LAPS-SD) preempt all along. A roomy cache
    # keeps the preempted requests' KV in place; a tight one swaps it out to make room
    lengths = "oracle" if policy == "lp-sjf" else None  # laps-sd: the learned one (default)
    method = DraftMethod("chain", k=3)
    engine = make_engine(
        tiny_target_dir, tiny_draft_dir, method, target_kv_bytes=kv_blocks * PER_BLOCK,
        max_running_requests=2, policy=policy, length_predictor=lengths,
    )  # fmt: skip
    plain = make_engine(tiny_target_dir, None, None)
    prompts = [[5, 6, 7, i] for i in range(5)]
    params = [SamplingParams(max_tokens=6 + 3 * i) for i in range(5)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for _ in range(2000):  # bounded: a livelock fails here instead of hanging
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "the scheduler stopped making progress"
    got = [engine.requests[i].output for i in ids]
    want = [r.output for r in plain.generate(prompts, params)]
    assert got == want
    assert engine.stats.num_drafts > 0  # speculation ran
    if policy == "las":  # and requests were preempted on the way, the way memory allowed
        assert engine.core.preemptions[kind] > 0, engine.core.preemptions
    if policy == "fcfs" and kv_blocks > 100:  # FCFS preempts only for memory
        assert not engine.core.preemptions


def test_a_request_still_prefilling_is_not_preempted() -> None:
    # two requests taking turns at a half-done prompt could each start over forever
    half = make_request("half", prompt=30)
    half.num_prefilled, half.attained_service_ms = 8, 500
    assert LAS().preempt([half], [decoded("new")], PolicyContext(0.0, None, 1)) == []


def test_a_preempted_request_keeps_its_kv_and_resumes_without_prefill() -> None:
    core = make_core(token_budget=32, max_running=1, policy=LAS())
    ex = executor(core, FakeKV(), agree=0.9)
    core.add(make_request("a", 6, max_tokens=30))
    ex.step()  # a prefills
    ex.step()  # a decodes: it has attained service now
    assert ex.kv is not None
    held = ex.kv.held["a"]
    core.add(make_request("b", 6, max_tokens=3))
    assert ex.schedule()  # b has less service: a steps aside
    batch = ex.batches[-1]
    assert [r.request_id for r, _ in batch.prefill] == ["b"] and not batch.decode
    a = core.requests["a"]
    assert a.kv == "kept" and a in core.waiting and core.preemptions == {"kept": 1}
    assert not batch.drop and not batch.swap_out and ex.target_releases["a"] == 0
    assert ex.kv.held["a"] == held and a.drafter is not None  # verifier's and drafter's state
    ex.finish_one()
    ex.run()
    assert ex.streamed["a"] == greedy(core_prompt("a", 6), 30)
    assert ex.streamed["b"] == greedy(core_prompt("b", 6), 3)
    later = ex.batches[3:]
    assert not any(r.request_id == "a" for b in later for r, _ in b.prefill)  # no recompute
    assert sum(any(r.request_id == "a" for r in b.decode) for b in later) >= 2
    assert core.preemptions["recomputed"] == core.preemptions["swapped"] == 0
    check_releases(ex, ["a", "b"])


@pytest.mark.parametrize("can_swap", [True, False])
def test_memory_pressure_moves_a_kept_request_out_first(can_swap: bool) -> None:
    # a (kept) holds the cache; c arrives with a prompt that only fits once a's KV is out
    core = make_core(token_budget=64, max_running=1, policy=LAS(), method=None)
    kv = FakeKV(num_blocks=8, block_size=4, can_swap=can_swap)
    ex = executor(core, kv)
    core.add(make_request("a", 16, max_tokens=8))
    ex.step()
    ex.step()
    core.add(make_request("b", 2, max_tokens=2))
    ex.step()  # a is kept, b prefills
    assert core.requests["a"].kv == "kept"
    core.add(make_request("c", 20, max_tokens=2))
    ex.run()
    kind = "swapped" if can_swap else "recomputed"
    assert core.preemptions["kept"] >= 1 and core.preemptions[kind] >= 1
    assert ex.streamed["a"] == greedy(core_prompt("a", 16), 8)
    check_releases(ex, ["a", "b", "c"])
    assert ex.oom_errors == 0
