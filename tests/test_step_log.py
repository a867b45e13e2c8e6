"""tools.step_log: the scheduler's step lines split into steps that verified drafts and not."""

from __future__ import annotations

from tools.sim.calibrate import parse_log
from tools.step_log import summarize


def line(decoding: int, nodes: int, planned: int, committed: int, step_ms: float) -> str:
    return (
        f"DEBUG micro-batch 1: {decoding} decoding ({nodes} tree nodes, {planned} planned drafts), "
        f"0 prefilling (0 tokens), context 90, {committed} tokens committed; draft 2.0 ms, "
        f"verify {step_ms - 5:.1f} ms, step {step_ms:.1f} ms"
    )


def test_steps_are_split_by_whether_they_verified_draft_nodes() -> None:
    lines = [
        line(4, 12, 4, 10, 300.0),  # drafted: 10 tokens for 4 requests
        line(4, 4, 0, 4, 200.0),  # plain
        line(2, 5, 1, 4, 250.0),  # drafted
        # a step with a prompt chunk is neither, and a line from before the counts were logged
        "DEBUG micro-batch 2: 1 decoding (1 tree nodes), 1 prefilling (40 tokens), context 300; "
        "draft 0.0 ms, verify 60.0 ms, step 90.0 ms",
    ]
    sums = summarize(parse_log(lines))
    drafted, plain = sums["drafted"], sums["plain"]
    assert (drafted.steps, drafted.request_steps, drafted.committed) == (2, 6, 14)
    assert (plain.steps, plain.request_steps, plain.committed) == (1, 4, 4)
    assert drafted.planned == 5 and drafted.step_ms == 550.0
    assert "| drafted | 2 | 2.33 |" in drafted.row("drafted")
