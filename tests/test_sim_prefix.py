"""The simulator with prefix caching: prompts drawn from Mooncake-style `hash_ids` hit the
simulated verifier's cache as the trace says they share, and only uncached tokens cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.scheduling.config import SchedulerConfig
from tests.test_simulator import VERIFY_MS, chain_recording, made_up_cost
from tools.load.readers import read_trace, write_trace
from tools.load.trace import TraceError, TraceRequest
from tools.sim.prefix import hashed_prompt, trace_hit_rate
from tools.sim.simulator import SimConfig, SimRequest, Simulator
from tools.traces import scale_hash_blocks, with_system_prompt

# (arrival s, input length, hash ids): r1 and r2 arrive together and share r0's first block;
# r3 continues r1's conversation (its full blocks; r1's last, partial one is a block of its own)
TRACE = [
    (0.0, 1000, (0, 1)),
    (1.0, 1400, (0, 2, 3)),
    (1.0, 900, (0, 4)),
    (2.0, 1800, (0, 2, 6, 7)),
]


def run(caching: bool) -> tuple[Simulator, list[float]]:
    config = SimConfig(
        SchedulerConfig(planner="fixed", tree_selection="global-greedy"),
        drafts=("d",),
        max_context=4096,
        prefix_caching=caching,
    )
    sim = Simulator(config, made_up_cost(), chain_recording())
    requests = [SimRequest(t, n, 4, kind="chat", hash_ids=ids) for t, n, ids in TRACE]
    records = sim.run(requests)
    return sim, [r.first_token_s - r.arrival_s for r in records]  # type: ignore[operator]


def test_hit_rate_is_the_traces_own() -> None:
    sim, _ = run(caching=True)
    total, hits = trace_hit_rate((n, ids) for _, n, ids in TRACE)
    assert (total, hits) == (5100, 512 + 512 + 1024)
    assert sim.prompt_tokens == total
    assert sim.cached_prompt_tokens == hits


def test_only_uncached_tokens_cost() -> None:
    _, ttft_on = run(caching=True)
    _, ttft_off = run(caching=False)
    # budget 512 a step, every verify step 10 ms: r3's 1800 tokens take 4 steps uncached, and
    # 2 cached (1024 found, 776 computed)
    assert ttft_off[3] == pytest.approx(4 * VERIFY_MS / 1000)
    assert ttft_on[3] == pytest.approx(2 * VERIFY_MS / 1000)
    assert ttft_on[0] == ttft_off[0]


def test_hashed_prompts_share_exactly_their_blocks() -> None:
    a = hashed_prompt((0, 1), 700, 1000)
    b = hashed_prompt((0, 2), 600, 1000)
    assert len(a) == 700 and a[:512] == b[:512] and a[512:600] != b[512:]
    with pytest.raises(ValueError, match="hash_ids"):
        hashed_prompt((0,), 700, 1000)


def test_traces_keep_hash_ids_and_scale_them(tmp_path: Path) -> None:
    requests = [
        TraceRequest(0.0, input_length=1100, output_length=4, hash_ids=(0, 1, 2)),
        TraceRequest(1.0, input_length=600, output_length=4, hash_ids=(0, 3)),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests
    scaled = scale_hash_blocks(requests, 32)
    assert [r.input_length for r in scaled] == [69, 38]  # within 2 and 3 blocks of 32
    assert [r.hash_ids for r in scaled] == [(0, 1, 2), (0, 3)]
    with pytest.raises(TraceError, match="hash_ids"):
        path.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1, "x"]}\n')
        read_trace(path)


def test_a_system_prompt_goes_in_front_of_every_request() -> None:
    requests = [TraceRequest(0.0, prompt="a"), TraceRequest(1.0, messages=(("user", "b"),))]
    out = with_system_prompt(requests, "rules")
    assert [r.messages for r in out] == [
        (("system", "rules"), ("user", "a")),
        (("system", "rules"), ("user", "b")),
    ]
    assert all(r.prompt is None and r.input_length is None for r in out)
