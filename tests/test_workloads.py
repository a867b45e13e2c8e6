"""The copy-heavy workloads (`tools/workloads.py`) and the trace generator that mixes them."""

from __future__ import annotations

import pytest

from tools.load.prompts import synthesize
from tools.load.readers import read_trace, write_trace
from tools.workloads import COPY_KINDS, SIZES, workload_messages


@pytest.mark.parametrize("kind", COPY_KINDS)
def test_each_workload_is_conversations_ending_with_a_user_turn(kind):
    conversations = workload_messages(kind)
    assert len(conversations) == SIZES[kind] >= 5
    for conversation in conversations:
        assert conversation[-1][0] == "user"
        assert all(role in ("system", "user", "assistant") and text for role, text in conversation)
    assert workload_messages(kind, 2) == conversations[:2]
    with pytest.raises(ValueError):
        workload_messages(kind, SIZES[kind] + 1)


def test_agent_loops_repeat_their_tool_outputs():
    for conversation in workload_messages("agent"):
        outputs = [text for role, text in conversation if role == "user"][1:]
        assert len(outputs) > len(set(outputs))  # some tool output comes back verbatim


def test_trace_mixes_the_workloads_with_the_datasets_and_names_applications(tmp_path):
    kinds = ["everyday", "code-edit", "revision", "passage-qa", "agent"]
    trace = synthesize(2.0, count=10, kinds=kinds, output_length=64, app_per_kind=True, seed=3)
    assert [r.kind for r in trace] == kinds * 2
    assert all(r.app == r.kind and r.messages for r in trace)
    agent = next(r for r in trace if r.kind == "agent")
    assert agent.messages in workload_messages("agent")
    path = tmp_path / "mix.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace
    plain = synthesize(2.0, count=2, kinds=["revision"], output_length=8)
    assert plain[0].app is None


def test_trace_refuses_an_input_length_for_the_workloads():
    with pytest.raises(ValueError, match="input length"):
        synthesize(1.0, count=2, kinds=["code-edit"], input_length=100)
    with pytest.raises(ValueError, match="kinds"):
        synthesize(1.0, count=2, kinds=["poetry"])
