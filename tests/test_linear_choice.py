"""The per-shape linear kernel plan: every kernel computes F.linear, the choice is a pure function
of the timings, and a planned model gives the unplanned model's logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shared.model import load_model
from shared.model.linear import (
    BASELINE,
    LinearPlan,
    PlannedLinear,
    available_kernels,
    bucket_index,
    choose,
    four_rows,
    two_rows,
)
from shared.model.runner import ModelRunner
from tests.helpers import paged_logits

BUCKETS = (1, 2, 3, 5, 9, 17)
KERNELS = available_kernels(torch.device("cpu"))


def uniform_plan(kernel: str, roles=("qkv", "o", "gate_up", "down", "lm_head")) -> LinearPlan:
    return LinearPlan(BUCKETS, {r: (kernel,) * len(BUCKETS) for r in roles})


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_is_f_linear(kernel: str, bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 48, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    lin = PlannedLinear(w, b, "qkv", uniform_plan(kernel), KERNELS)
    for n in (1, 2, 3, 4, 5, 9, 17, 40):  # 4 falls in bucket 5; 40 is past the last bucket
        x = torch.randn(n, 48, generator=gen)
        y = lin(x)
        assert y.shape == (n, 200) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_bucket_of_a_token_count() -> None:
    assert [bucket_index(BUCKETS, n) for n in (1, 2, 4, 5, 6, 17, 18)] == [0, 1, 3, 3, 4, 5, None]
    plan = LinearPlan(BUCKETS, {"o": ("a", "b", "c", "d", "e", "f")})
    assert [plan.kernel_for("o", n) for n in (1, 3, 4, 10, 17, 18)] == [
        "a",
        "c",
        "d",
        "f",
        "f",
        BASELINE,
    ]
    assert plan.kernel_for("unplanned_role", 1) == BASELINE


def _timings() -> dict[str, dict[str, tuple[float, ...]]]:
    # seconds per call per bucket, made up: w_xt (in place) wins small n, x_wt (a copy) wins
    # n = 1 by 50 %, F.linear wins big n.
    return {
        "gate_up": {
            "linear": (10, 20, 30, 30, 30, 30),
            "x_wt": (5, 25, 35, 35, 35, 35),
            "w_xt": (10, 8, 9, 40, 40, 40),
        },
        "o": {
            "linear": (10, 10, 10, 10, 10, 10),
            "x_wt": (9.5, 9.5, 9.5, 9.5, 9.5, 9.5),  # 5 % better: not worth a copy at 10 %
            "w_xt": (11, 11, 11, 11, 11, 11),
        },
    }


def test_choice_is_a_function_of_the_timings() -> None:
    plans = [choose(_timings(), BUCKETS, KERNELS) for _ in range(3)]
    assert all(p == plans[0] for p in plans)
    plan = plans[0]
    assert plan.choices["gate_up"] == ("x_wt", "w_xt", "w_xt", "linear", "linear", "linear")
    assert plan.choices["o"] == ("linear",) * 6
    # Copies refused outright, or worth it at a 1 % threshold.
    no_copy = choose(_timings(), BUCKETS, KERNELS, copy_gain=math.inf)
    assert no_copy.choices["gate_up"] == ("linear", "w_xt", "w_xt", "linear", "linear", "linear")
    assert choose(_timings(), BUCKETS, KERNELS, copy_gain=0.01).choices["o"] == ("x_wt",) * 6
    # A plan survives a round trip through plain data unchanged.
    assert LinearPlan.from_dict(plan.to_dict()) == plan


def test_choice_prefers_one_batch_invariant_kernel_when_nearly_as_fast() -> None:
    timings = _timings()
    timings["o"]["w_xt"] = (10.4, 10.4, 10.4, 10.4, 10.4, 10.4)  # within 5 % of F.linear
    plan = choose(timings, BUCKETS, KERNELS, invariant={"o": ("w_xt",), "gate_up": ("w_xt",)})
    assert plan.choices["o"] == ("w_xt",) * 6
    # gate_up: w_xt is far slower in some buckets, so the per-bucket choice stands.
    assert plan.choices["gate_up"] == ("x_wt", "w_xt", "w_xt", "linear", "linear", "linear")
    strict = choose(timings, BUCKETS, KERNELS, invariant={"o": ("w_xt",)}, uniform_tolerance=0)
    assert strict.choices["o"] == ("linear",) * 6


def test_past_the_buckets_a_uniform_invariant_kernel_serves_on() -> None:
    """A forward of more tokens than the largest bucket (a large tree, a prompt chunk) keeps the
    kernel every bucket uses when it is batch-invariant, so its tokens round as one token does;
    otherwise it runs F.linear."""
    invariant = {"qkv": ("onednn_packed_two_rows",)}
    uniform = LinearPlan(BUCKETS, {"qkv": ("onednn_packed_two_rows",) * 6}, invariant=invariant)
    assert uniform.kernel_for("qkv", 18) == "onednn_packed_two_rows"
    assert uniform.kernel_for("qkv", 500) == "onednn_packed_two_rows"
    not_invariant = LinearPlan(BUCKETS, {"qkv": ("onednn_packed",) * 6}, invariant=invariant)
    assert not_invariant.kernel_for("qkv", 18) == BASELINE
    mixed = LinearPlan(BUCKETS, {"qkv": ("onednn_packed_two_rows",) * 5 + ("linear",)})
    assert mixed.kernel_for("qkv", 18) == BASELINE


def test_a_single_row_is_multiplied_as_two() -> None:
    seen: list[int] = []

    def fake(x: torch.Tensor, p: dict, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(x.shape[0])
        return F.linear(x, p["w"], bias)

    w = torch.randn(8, 4)
    x = torch.randn(1, 4)
    y = two_rows(fake)(x, {"w": w}, None)
    assert seen == [2] and y.shape == (1, 8)
    torch.testing.assert_close(y, F.linear(x, w))
    two_rows(fake)(torch.randn(3, 4), {"w": w}, None)
    assert seen == [2, 3]


def test_up_to_three_rows_are_multiplied_as_four() -> None:
    seen: list[int] = []

    def fake(x: torch.Tensor, p: dict, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(x.shape[0])
        return F.linear(x, p["w"], bias)

    w, b = torch.randn(8, 4), torch.randn(8)
    for n in (1, 2, 3, 4, 6):
        x = torch.randn(n, 4)
        y = four_rows(fake)(x, {"w": w}, b)
        assert y.shape == (n, 8)
        torch.testing.assert_close(y, F.linear(x, w, b))
    assert seen == [4, 4, 4, 4, 6]


def test_choice_takes_an_invariant_kernel_by_its_total_time() -> None:
    """Per-bucket noise does not break the uniform choice: an invariant kernel within the
    tolerance summed over the buckets serves them all, though slower in one bucket."""
    timings = _timings()
    timings["o"]["w_xt"] = (9.0, 9.0, 9.0, 12.0, 9.5, 9.5)  # 20 % over F.linear at n = 5
    plan = choose(timings, BUCKETS, KERNELS, invariant={"o": ("w_xt",)})
    assert plan.choices["o"] == ("w_xt",) * 6


@pytest.fixture(scope="module")
def tiny_tokens() -> list[int]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 96, (40,), generator=gen).tolist()


def _logits(model, tokens: list[int], split: int) -> torch.Tensor:
    runner = ModelRunner(model, block_size=4, kv_memory_bytes=4 << 20)
    return paged_logits(runner, tokens, split)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_planned_model_gives_the_same_logits(tiny_target_dir, tiny_tokens, kernel: str) -> None:
    model = load_model(tiny_target_dir)
    plain = _logits(model, tiny_tokens, 23)  # prefill 23 (past the buckets), then 17 at once
    model.set_linear_plan(uniform_plan(kernel))
    assert (model.planned_extra_bytes() > 0) == bool(KERNELS[kernel].layout)
    torch.testing.assert_close(_logits(model, tiny_tokens, 23), plain, rtol=1e-4, atol=1e-4)
    # n = 1 .. 5 at a time through the cached path
    for split in (35, 36, 38, 39):
        torch.testing.assert_close(_logits(model, tiny_tokens, split), plain, rtol=1e-4, atol=1e-4)
    model.set_linear_plan(None)
    torch.testing.assert_close(_logits(model, tiny_tokens, 23), plain, rtol=0, atol=0)


def test_measured_plan_gives_the_same_logits(tiny_target_dir, tiny_tokens) -> None:
    model = load_model(tiny_target_dir)
    plain = _logits(model, tiny_tokens, 30)
    plan = model.plan_kernels((1, 2, 5, 10), rounds=1)
    assert set(plan.choices) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all(len(c) == 4 and set(c) <= set(KERNELS) for c in plan.choices.values())
    torch.testing.assert_close(_logits(model, tiny_tokens, 30), plain, rtol=1e-4, atol=1e-4)
    # Applying the same plan elsewhere (another process) gives the same choices.
    other = load_model(tiny_target_dir)
    assert other.plan_kernels(plan=LinearPlan.from_dict(plan.to_dict())) == plan
