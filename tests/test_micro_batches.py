"""The micro-batch heuristic: the pipeline cycle the cost profile predicts picks M, and the core
keeps no more micro-batches in flight than it picked."""

from __future__ import annotations

from pathlib import Path

from shared.scheduling.core import CoreConfig, SchedulerCore
from shared.scheduling.cost_model import (
    CostModel,
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
)
from shared.scheduling.draft_choice import ChooserTraits
from shared.scheduling.micro_batches import StepShape, choose_micro_batches, cycle_ms
from shared.values.methods import DraftMethod
from tests.test_scheduler_core import FakeKV, executor, greedy, make_request

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
    assert fixed.config.micro_batch_split == "policy"
    split = build_core(
        AugurySettings(scheduler={"micro_batch_split": "per-draft"}), TargetInfo(96, 4096), [], None
    )
    assert split.config.micro_batch_split == "per-draft"


class ByName(ChooserTraits):
    """Draft model by request name: "b*" drafts with "big", the rest with "small"."""

    name = "by-name"
    learns = False

    def assign(self, requests, live_models, cost):  # noqa: ANN001, ANN201
        return {r.request_id: "big" if r.request_id[0] == "b" else "small" for r in requests}

    def observe(self, outcome) -> None:  # noqa: ANN001
        pass

    def next_model(self, request, live_models) -> None:  # noqa: ANN001
        return None

    def forget(self, request_id: str) -> None:
        pass


def _decode_mix(split: str) -> list[dict[str | None, int]]:
    """Per decode micro-batch of two in flight: how many of its requests each draft holds."""
    core = SchedulerCore(
        CoreConfig(
            vocab_size=96,
            max_context=4096,
            micro_batches=2,
            micro_batch_split=split,  # type: ignore[arg-type]
            method=DraftMethod("chain", k=2),
            planner="fixed",
        ),
        chooser=ByName(),
    )
    core.set_drafters({"big": ["b0"], "small": ["s0"]})
    ex = executor(core, FakeKV())
    names = [f"b{i}" for i in range(6)] + [f"s{i}" for i in range(6)]  # the big ones come first
    for name in names:
        core.add(make_request(name, 4, max_tokens=30))
    mixes = []
    while core.has_unfinished():
        while ex.schedule():
            pass
        for batch in ex.batches[-len(ex.inflight) :]:
            if len(batch.decode) == len(names) // 2 and all(r.draft_model for r in batch.decode):
                mix: dict[str | None, int] = {}
                for r in batch.decode:
                    mix[r.draft_model] = mix.get(r.draft_model, 0) + 1
                mixes.append(mix)
        while ex.inflight:
            ex.finish_one()
    for name in names:
        assert ex.streamed[name] == greedy(make_request(name, 4).prompt, 30)
    return mixes


def test_the_per_draft_split_gives_each_micro_batch_its_share_of_every_drafter() -> None:
    policy, per_draft = _decode_mix("policy"), _decode_mix("per-draft")
    assert policy and per_draft
    assert any(mix.get("big") == 6 for mix in policy)  # the policy's order: the big ones together
    # Spin: half of each; the first decode step picks before any request has a draft model
    assert all(mix == {"big": 3, "small": 3} for mix in per_draft[1:])
