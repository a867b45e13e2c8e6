"""Unit tests of the scheduler's pieces: tree selection, policy, batching, replica choice,
stop handling, reply settling, method conversion. No Redis, no models."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.drafter.methods import engine_method
from services.scheduler.batching import BatchLimits, form_batch, tree_nodes
from services.scheduler.drafters import DrafterDirectory, FixedDraftModel
from services.scheduler.policy import FCFS, make_policy
from services.scheduler.replies import Replies
from services.scheduler.request import PoolRequest, append_tokens
from services.scheduler.selection import GlobalGreedy, make_selector
from services.scheduler.service import wire_method
from shared.engine.drafting import DraftMethod
from shared.engine.sampling import SamplingParams
from shared.engine.spec_engine import tree_capacity
from shared.engine.tree import SparseDist, TokenTree
from shared.settings import SpeculationSettings
from shared.wire import BeamMethod, ChainMethod, DynamicTreeMethod, StaticTreeMethod, Submit


def request(rid: str, prompt_len: int = 4, arrival: int = 0, **params: object) -> PoolRequest:
    submit = Submit(
        rid,
        tuple(range(1, prompt_len + 1)),
        SamplingParams(**params),
        "out",
        0.0,  # type: ignore[arg-type]
    )
    return PoolRequest.from_submit(submit, seed=1, arrival=arrival)


def decoding(rid: str, arrival: int = 0) -> PoolRequest:
    r = request(rid, arrival=arrival, max_tokens=50)
    r.num_prefilled = len(r.prefill_tokens)
    r.output = [9]
    return r


# ---- tree selection ----------------------------------------------------------------------------


def test_global_greedy_takes_the_most_probable_nodes_across_requests() -> None:
    a = TokenTree.chain(1, [2, 3, 4], np.log([0.9, 0.9, 0.9]).tolist())  # f: .9 .81 .73
    b = TokenTree.chain(5, [6, 7], np.log([0.5, 0.5]).tolist())  # f: .5 .25
    picked = GlobalGreedy().select({"a": a, "b": b}, budget=6, max_depth={})
    assert picked["a"].tokens.tolist() == [1, 2, 3, 4]
    assert picked["b"].tokens.tolist() == [5, 6]
    tight = GlobalGreedy().select({"a": a, "b": b}, budget=2, max_depth={})
    assert [t.num_nodes for t in tight.values()] == [1, 1]  # roots always, nothing else


def test_global_greedy_respects_depth_limits_and_keeps_parents() -> None:
    tree = TokenTree.build(
        [1, 2, 3, 4, 5], [-1, 0, 0, 1, 3], np.log([1, 0.6, 0.4, 0.5, 0.9]).tolist()
    )
    picked = GlobalGreedy().select({"r": tree}, budget=10, max_depth={"r": 2})
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
    picked = GlobalGreedy().select({"r": tree}, budget=3, max_depth={})
    assert picked["r"].tokens.tolist() == [1, 7, 8]  # the first two draws, not the likeliest


def test_unknown_policy_and_selector_are_refused() -> None:
    assert isinstance(make_policy("fcfs"), FCFS)
    with pytest.raises(ValueError, match="unknown"):
        make_policy("nope")
    with pytest.raises(ValueError, match="unknown"):
        make_selector("nope")


# ---- policy and batching -----------------------------------------------------------------------


def test_fcfs_orders_by_priority_then_arrival() -> None:
    a, b, c = request("a", arrival=0), request("b", arrival=1), request("c", arrival=2)
    c.priority = -1
    assert [r.request_id for r in FCFS().order([b, a, c])] == ["c", "a", "b"]


def test_micro_batches_split_the_running_set() -> None:
    running = [decoding(f"r{i}", i) for i in range(8)]
    limits = BatchLimits(token_budget=512, max_running=64, micro_batches=2, tree_nodes=5)
    first, _ = form_batch(1, running, [], limits, admit=True)
    assert len(first.decode) == 4
    for r in first.members:
        r.in_flight = True
    second, _ = form_batch(2, running, [], limits, admit=True)
    assert {r.request_id for r in second.decode}.isdisjoint(r.request_id for r in first.decode)
    assert len(second.decode) == 4
    for r in second.members:
        r.in_flight = True
    third, _ = form_batch(3, running, [], limits, admit=True)
    assert not third.members


def test_admission_chunks_prompts_within_the_token_budget() -> None:
    waiting = [request("long", prompt_len=300), request("short", prompt_len=10, arrival=1)]
    limits = BatchLimits(token_budget=256, max_running=64, micro_batches=1, tree_nodes=5)
    batch, admitted = form_batch(1, [], waiting, limits, admit=True)
    assert [r.request_id for r in admitted] == ["long"]
    assert batch.prefill_tokens == 256
    running = [decoding("d")]
    batch, admitted = form_batch(2, running, waiting, limits, admit=False)
    assert not admitted and [r.request_id for r in batch.decode] == ["d"]
    limited = BatchLimits(token_budget=256, max_running=1, micro_batches=1, tree_nodes=5)
    _, admitted = form_batch(3, running, waiting, limited, admit=True)
    assert not admitted


def test_tree_sizes_match_the_engine() -> None:
    pairs = [
        (ChainMethod(4), DraftMethod("chain", k=4)),
        (StaticTreeMethod((2, 2, 1)), DraftMethod("static", expansion=(2, 2, 1))),
        (BeamMethod(3, 2), DraftMethod("beam", depth=3, width=2)),
        (DynamicTreeMethod(12, 5, 3), DraftMethod("dynamic", budget=12, max_size=12)),
    ]
    for wire, engine in pairs:
        assert tree_nodes(wire) == tree_capacity(engine)
        assert engine_method(wire).kind == engine.kind
    assert engine_method(DynamicTreeMethod(12, 5, 3), batch_size=4).budget == 48
    assert wire_method(SpeculationSettings(method="none")) is None
    assert wire_method(SpeculationSettings(method="beam")) == BeamMethod(4, 2)


# ---- stops, replicas, replies ------------------------------------------------------------------


def test_stop_tokens_end_the_request_without_being_emitted() -> None:
    r = request("s", max_tokens=10, stop_token_ids=(7,))
    assert append_tokens(r, [3, 4, 7, 5], eos_token_ids=()) == [3, 4]
    assert r.finish_reason == "stop"
    eos = request("e", max_tokens=10)
    assert append_tokens(eos, [3, 2], eos_token_ids=(2,)) == [3]
    ignoring = request("i", max_tokens=3, ignore_eos=True)
    assert append_tokens(ignoring, [2, 2, 2, 2], eos_token_ids=(2,)) == [2, 2, 2]
    assert ignoring.finish_reason == "length"


def test_drafter_replicas_are_sticky_and_least_loaded() -> None:
    directory = DrafterDirectory(bus=None, cell="c", chooser=FixedDraftModel(["big"]))  # type: ignore[arg-type]
    directory.replicas = {"small": ["s0"], "big": ["b0", "b1"]}
    reqs = [decoding(f"r{i}") for i in range(4)]
    for r in reqs:
        assert directory.assign(r)
    assert [r.drafter for r in reqs] == ["b0", "b1", "b0", "b1"]
    reqs[0].num_seen_by_drafter = 12
    assert directory.assign(reqs[0]) and reqs[0].drafter == "b0"
    assert reqs[0].num_seen_by_drafter == 12  # kept: its draft KV is warm
    directory.replicas = {"small": ["s0"], "big": ["b1"]}  # b0 died
    assert directory.assign(reqs[0]) and reqs[0].drafter == "b1"
    assert reqs[0].num_seen_by_drafter == 0
    assert directory.left_behind == [("big", "b0", "r0")]
    asked = decoding("asked")
    asked.requested_draft = "small"
    assert directory.assign(asked) and asked.drafter == "s0"
    directory.replicas = {}
    assert not directory.assign(decoding("none"))


async def test_replies_hold_the_ack_until_settled() -> None:
    replies: Replies[str] = Replies()
    answer = replies.expect(("mb", 1))
    delivered = asyncio.ensure_future(replies.deliver(("mb", 1), "trees"))
    assert await answer == "trees"
    await asyncio.sleep(0.01)
    assert not delivered.done()  # the entry is not acked before the next hop is written
    replies.settle_where(lambda key: key[0] == "mb")
    await asyncio.wait_for(delivered, 1.0)
    await replies.deliver(("mb", 1), "again")  # a repeat: dropped at once
    assert replies.dropped == 1


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


test_replies_hold_the_ack_until_settled = pytest.mark.anyio(test_replies_hold_the_ack_until_settled)
