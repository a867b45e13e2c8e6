"""The micro-batch heuristic: the pipeline cycle the cost profile predicts picks M, and the core
keeps no more micro-batches in flight than it picked."""

from __future__ import annotations

from pathlib import Path

from shared.engine.methods import DraftMethod
from shared.scheduling.core import CoreConfig, SchedulerCore
from shared.scheduling.cost_model import (
    CostModel,
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
)
from shared.scheduling.micro_batches import StepShape, choose_micro_batches, cycle_ms
from tests.test_scheduler_core import FakeKV, executor, make_request

H100 = (
    Path(__file__).resolve().parent.parent
    / "profiles"
    / "SmolLM2-135M-Instruct-cuda-nvidia-h100-80gb-hbm3-bfloat16-t0.json"
)
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def curve(name: str, fixed_ms: float, per_token_ms: float, device: str) -> ModelProfile:
    key = ProfileKey(model=name, fingerprint="f", device=device, dtype="bfloat16", threads=0)
    grid = [[fixed_ms + per_token_ms * t] * 2 for t in TOKENS]
    return ModelProfile(
        key=key, curve=ForwardCurve(tokens=TOKENS, contexts=[0, 4096], ms_grid=grid)
    )


def model(verify: tuple[float, float], draft: tuple[float, float], device: str) -> CostModel:
    """A target whose forward costs fixed + per token * tokens, and one draft `d`."""
    return CostModel(
        CostProfile(target=curve("t", *verify, device), drafts={"d": curve("d", *draft, device)})
    )


def choose(cost: CostModel, *, shared: bool, requests: int = 16) -> int:
    return choose_micro_batches(
        cost, "d", requests, 5, 2, 256, max_micro_batches=6, max_drop=0.1, shared_device=shared
    )


def test_pipelining_pays_where_verification_grows_with_tokens_and_drafting_is_latency_bound() -> (
    None
):
    # verifying 80 tokens costs 80 ms (halves with a half batch), drafting 2 levels costs 20
    cost = model(verify=(0.0, 1.0), draft=(10.0, 0.0), device="cuda: test")
    cycles = [cycle_ms(cost, "d", 16, m, 5, 2, 256, shared_device=False) for m in (1, 2, 4)]
    assert cycles[0] > cycles[1] == cycles[2]  # D + V, then the verifier's 80 ms alone
    assert choose(cost, shared=False) == 2  # the fewest micro-batches at the shortest cycle


def test_no_pipelining_where_a_forward_costs_the_same_for_any_batch() -> None:
    flat = model(verify=(20.0, 0.0), draft=(2.0, 0.0), device="cuda: test")
    assert choose(flat, shared=False) == 1  # two half forwards cost two whole ones
    assert choose(CostModel(CostProfile.load(H100)), shared=False) == 1


def test_one_shared_device_never_pipelines() -> None:
    cost = model(verify=(0.0, 1.0), draft=(10.0, 0.0), device="cpu: test")
    assert choose(cost, shared=True) == 1
    assert choose(cost, shared=False, requests=1) == 1  # one request: nothing to split


def test_step_shape_follows_what_was_verified() -> None:
    shape = StepShape()
    assert shape.typical(17, 6) == (17, 6)  # the method's bounds until something is seen
    for _ in range(200):
        shape.observe(3, 2)
    assert shape.typical(17, 6) == (3, 2)


def test_the_core_keeps_at_most_the_chosen_number_of_micro_batches_in_flight() -> None:
    cost = model(verify=(0.0, 1.0), draft=(10.0, 0.0), device="cuda: test")
    core = SchedulerCore(
        CoreConfig(
            vocab_size=96,
            max_context=4096,
            micro_batches=6,  # the most
            auto_micro_batches=True,
            method=DraftMethod("chain", k=2),
        ),
        cost=cost,
    )
    ex = executor(core, FakeKV())
    for i in range(16):
        core.add(make_request(f"r{i}", 4, max_tokens=200))
    assert core.num_micro_batches(16) == 2  # from the method's bounds: nothing observed yet
    most = 0
    for _ in range(40):  # run a while: prefills, then decoding (the observed shape may change M)
        while ex.schedule():
            pass
        chosen = core.num_micro_batches(len(core.running) + len(core.waiting))
        assert len(ex.inflight) <= chosen
        most = max(most, len(ex.inflight))
        while ex.inflight:
            ex.finish_one()
    assert most == 2  # the executor would have taken six
    fixed = SchedulerCore(CoreConfig(vocab_size=96, max_context=4096, micro_batches=3), cost=cost)
    assert fixed.num_micro_batches(16) == 3  # the setting, as it is


def test_the_setting_auto_starts_the_most_lanes_and_lets_the_core_choose() -> None:
    from shared.scheduling.factory import TargetInfo, build_core
    from shared.settings import AugurySettings

    settings = AugurySettings(scheduler={"micro_batches": "auto", "max_micro_batches": 5})
    core = build_core(settings, TargetInfo(96, 4096), ["d"], None)
    assert core.config.auto_micro_batches and core.config.micro_batches == 5
    fixed = build_core(
        AugurySettings(scheduler={"micro_batches": 3}), TargetInfo(96, 4096), [], None
    )
    assert not fixed.config.auto_micro_batches and fixed.config.micro_batches == 3
