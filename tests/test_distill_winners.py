"""`distill winners`: which contender serves each request fastest, from per-request target
forwards and this machine's round costs (hand-made numbers, so every winner is known)."""

from __future__ import annotations

from distill.evaluate import (
    Costs,
    Reference,
    accepted_by_kind,
    iteration_seconds,
    winners_from_forwards,
)

# target: 10 ms per decode step; verifying a chain of 4 (5 tokens) 12 ms; draft steps 1 / 3 ms
COSTS = Costs(
    target_decode=0.010,
    target_verify={1: 0.010, 5: 0.012, 9: 0.014},
    draft_step={"fast": {1: 0.001, 2: 0.001}, "slow": {1: 0.003, 2: 0.003}},
)


def ref(kind: str, n_tokens: int) -> Reference:
    return Reference(kind, prompt=[1, 2, 3], continuation=list(range(n_tokens + 1)))


def test_round_costs_are_what_the_winners_compare() -> None:
    assert abs(iteration_seconds(COSTS, "fast", (1, 1, 1, 1)) - 0.016) < 1e-12
    assert abs(iteration_seconds(COSTS, "slow", (1, 1, 1, 1)) - 0.024) < 1e-12


def test_each_request_goes_to_its_fastest_contender() -> None:
    refs = [ref("chat", 40), ref("chat", 40), ref("code", 40), ref("everyday", 40)]
    # 40 tokens: plain decoding 400 ms; fast 16 ms/round, slow 24 ms/round
    forwards = {
        "fast": [10, 30, 20, 20],  # 160, 480, 320, 320 ms
        "slow": [12, 12, 10, 20],  # 288, 288, 240, 480 ms
    }
    result = winners_from_forwards(refs, forwards, COSTS, chain=4)
    assert result["winners_chain"] == {
        "chat": {"fast": 1, "slow": 1},
        "code": {"slow": 1},
        "everyday": {"fast": 1},
        "mix": {"fast": 2, "slow": 2},
    }
    assert result["winners_chain_drafts_only"] == result["winners_chain"]


def test_plain_decoding_wins_when_speculation_does_not_pay() -> None:
    refs = [ref("math", 40)]
    forwards = {"fast": [30], "slow": [40]}  # 480 and 960 ms against 400 ms plain
    result = winners_from_forwards(refs, forwards, COSTS, chain=4)
    assert result["winners_chain"] == {
        "math": {"none (target only)": 1},
        "mix": {"none (target only)": 1},
    }
    assert result["winners_chain_drafts_only"] == {"math": {"fast": 1}, "mix": {"fast": 1}}


def test_mean_accepted_per_kind_pools_tokens_over_forwards() -> None:
    refs = [ref("chat", 40), ref("chat", 20), ref("code", 30)]
    forwards = {"fast": [20, 20, 10]}  # chat: 60 tokens / 40 forwards; code: 30 / 10
    assert accepted_by_kind(refs, forwards) == {"fast": {"chat": 1.5, "code": 3.0, "mix": 1.8}}
