"""The simulator: the scheduler core on a virtual clock, checked against latencies worked out by
hand from a made-up profile (every verify forward 10 ms, every draft forward 1 ms) and a made-up
acceptance recording (a two-token chain, both tokens accepted, at every step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import (
    CostModel,
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
)
from shared.values.methods import DraftMethod
from shared.values.tree import TokenTree
from tools.load.records import RequestRecord
from tools.sim.acceptance import AcceptanceModel, RecordedStep, Session, accepted_node
from tools.sim.simulator import SimConfig, SimRequest, Simulator

VERIFY_MS = 10.0
DRAFT_MS = 1.0
CHAIN = DraftMethod("chain", k=2)


def flat_profile(ms: float, model: str) -> ModelProfile:
    key = ProfileKey(model=model, fingerprint="f", device="cpu: test", dtype="float32", threads=1)
    curve = ForwardCurve(tokens=[1, 1024], contexts=[0], ms_grid=[[ms], [ms]])
    return ModelProfile(key=key, curve=curve)


def made_up_cost() -> CostModel:
    return CostModel(
        CostProfile(target=flat_profile(VERIFY_MS, "t"), drafts={"d": flat_profile(DRAFT_MS, "d")})
    )


def chain_recording(accepted: int = 2) -> AcceptanceModel:
    step = RecordedStep(parents=(0, 1), logq=(0.0, 0.0), accepted_node=accepted)
    return AcceptanceModel("t", CHAIN, [Session("chat", "d", 0, (step,))])


def simulate(
    requests: list[SimRequest], micro_batches: int = 1, **config: object
) -> list[RequestRecord]:
    scheduler = SchedulerConfig(
        planner="fixed", tree_selection="global-greedy", micro_batches=micro_batches
    )
    settings = {"drafts": ("d",), **config}
    sim = Simulator(SimConfig(scheduler, **settings), made_up_cost(), chain_recording())  # type: ignore[arg-type]
    return sim.run(requests)


def test_one_request_by_hand() -> None:
    # t=0 prefill (10 ms) -> first token at 0.010; each decode step drafts (root forward +
    # one layer forward = 2 ms), verifies (10 ms) and commits 2 accepted + 1 bonus token
    [record] = simulate([SimRequest(0.0, num_prompt_tokens=4, num_output_tokens=7, kind="chat")])
    assert record.first_token_s == pytest.approx(0.010)
    assert [t for t, _ in record.chunks] == pytest.approx([0.010, 0.022, 0.034])
    assert [n for _, n in record.chunks] == [1, 3, 3]
    assert record.finish_s == pytest.approx(0.034)
    assert record.num_output_tokens == 7 and record.finish_reason == "length"
    assert (record.drafts, record.draft_tokens, record.accepted_tokens) == (2, 4, 4)
    assert record.steps_by_draft == {"d": 2}


def test_step_overheads_add_to_every_micro_batch() -> None:
    # 1 ms per micro-batch plus 0.5 ms x sqrt(decoding requests): the prefill step pays 1 ms,
    # each decode step of the lone request 1.5 ms
    [record] = simulate(
        [SimRequest(0.0, num_prompt_tokens=4, num_output_tokens=7)],
        step_overhead_ms=1.0,
        request_overhead_ms=0.5,
    )
    assert [t for t, _ in record.chunks] == pytest.approx([0.011, 0.0245, 0.038])


def test_a_later_arrival_queues_then_shares_steps() -> None:
    a = SimRequest(0.0, num_prompt_tokens=4, num_output_tokens=7)
    b = SimRequest(0.005, num_prompt_tokens=4, num_output_tokens=7)
    ra, rb = simulate([a, b])
    # b waits for a's prefill (one micro-batch in flight), is prefilled beside a's first decode
    assert rb.first_token_s == pytest.approx(0.022)
    # then both decode together: one draft step for both (2 ms), one verify (10 ms)
    assert [t for t, _ in ra.chunks] == pytest.approx([0.010, 0.022, 0.034])
    assert [t for t, _ in rb.chunks] == pytest.approx([0.022, 0.034, 0.046])
    assert rb.finish_s - rb.arrival_s == pytest.approx(0.041)


def test_micro_batches_pipeline_on_separate_devices() -> None:
    # M=2: each micro-batch takes one request; drafting one overlaps verifying the other
    a = SimRequest(0.0, num_prompt_tokens=4, num_output_tokens=7)
    b = SimRequest(0.0, num_prompt_tokens=4, num_output_tokens=7)
    ra, rb = simulate([a, b], micro_batches=2, shared_device=False)
    assert [t for t, _ in ra.chunks] == pytest.approx([0.010, 0.030, 0.050])
    assert [t for t, _ in rb.chunks] == pytest.approx([0.020, 0.040, 0.060])
    # on one shared device the same drafts queue behind verification instead
    sa, sb = simulate([a, b], micro_batches=2, shared_device=True)
    assert sb.finish_s > rb.finish_s


def test_nothing_accepted_means_one_token_per_step() -> None:
    sim = Simulator(
        SimConfig(SchedulerConfig(planner="fixed", tree_selection="global-greedy"), drafts=("d",)),
        made_up_cost(),
        chain_recording(accepted=0),
    )
    [record] = sim.run([SimRequest(0.0, num_prompt_tokens=4, num_output_tokens=4)])
    assert [n for _, n in record.chunks] == [1, 1, 1, 1]
    # depth 2, then 1 (one token left to draft for), then none (the last token is the bonus)
    assert (record.drafts, record.draft_tokens, record.accepted_tokens) == (2, 3, 0)


def test_no_drafts_is_plain_decoding() -> None:
    [record] = simulate([SimRequest(0.0, 4, 3)], drafts=())
    assert [t for t, _ in record.chunks] == pytest.approx([0.010, 0.020, 0.030])
    assert record.drafts == 0


def test_a_request_too_long_for_the_context_fails_alone() -> None:
    ok, too_long = simulate([SimRequest(0.0, 4, 3), SimRequest(0.0, 9000, 3)], drafts=())
    assert ok.is_completed and not too_long.is_completed
    assert "context" in (too_long.error or "")


def test_unknown_draft_is_refused() -> None:
    with pytest.raises(ValueError, match="no recorded acceptance"):
        Simulator(SimConfig(drafts=("other",)), made_up_cost(), chain_recording())


# ---- the acceptance model ------------------------------------------------------------------------
def recorded_tree() -> RecordedStep:
    #        0
    #      /   \
    #     1     2        target accepts 2 then 4
    #     |    / \
    #     3   4   5
    return RecordedStep(
        parents=(0, 0, 1, 2, 2), logq=(-0.1, -1.0, -0.2, -0.3, -2.0), accepted_node=4
    )


def test_accepted_length_follows_the_selected_subtree() -> None:
    step = recorded_tree()
    model = AcceptanceModel("t", CHAIN, [Session("chat", "d", 0, (step,))])
    session = model.sessions[0]
    full = model.drafted(session, 0, max_depth=9)[0]
    assert full.num_nodes == 6
    assert model.num_accepted(session, 0, full) == 2
    assert model.num_accepted(session, 0, full.subtree([0, 2])) == 1  # 4 was not selected
    assert model.num_accepted(session, 0, full.subtree([0, 1, 3])) == 0  # the wrong branch
    shallow = model.drafted(session, 0, max_depth=1)[0]
    assert shallow.num_nodes == 3 and model.num_accepted(session, 0, shallow) == 1
    # a session's steps wrap round
    assert model.num_accepted(session, 5, full) == 2


def test_accepted_node_walks_the_accepted_tokens() -> None:
    tree = TokenTree.build([7, 8, 9, 10, 11], [-1, 0, 0, 2, 2], [0.0, -0.1, -0.2, -0.3, -0.4])
    assert accepted_node(tree, []) == 0
    assert accepted_node(tree, [9, 11]) == 4


def test_recording_round_trips(tmp_path: Path) -> None:
    model = AcceptanceModel("t", CHAIN, [Session("code", "d", 3, (recorded_tree(),))])
    for name in ("a.json", "a.json.gz"):
        loaded = AcceptanceModel.load(model.save(tmp_path / name))
        assert loaded.sessions == model.sessions and loaded.method == CHAIN
    assert loaded.mean_accepted_length() == {("code", "d"): 3.0}


def test_a_malformed_recording_is_refused() -> None:
    data = AcceptanceModel("t", CHAIN, [Session("code", "d", 0, (recorded_tree(),))]).to_json()
    data["sessions"][0]["steps"][0][0] = [0, 5, 1, 2, 2]  # a parent after its child
    with pytest.raises(ValueError, match="malformed"):
        AcceptanceModel.from_json(data)


def test_overheads_are_fitted_from_the_scheduler_log() -> None:
    from tools.sim.calibrate import fit_overheads, parse_log

    # every step took the verify forward (10 ms) plus 3 ms plus 2 ms x sqrt(decoding requests)
    lines = [
        f"x DEBUG micro-batch {i}: {d} decoding ({2 * d} tree nodes, {d} planned drafts), "
        f"1 prefilling (40 tokens), context 300, {d + 1} tokens committed; draft 1.5 ms, "
        f"verify 12.0 ms, step {1.5 + 10 + 3 + 2 * d**0.5:.4f} ms"
        for i, d in enumerate([1, 4, 9, 16, 25])
    ]
    steps = parse_log(["unrelated line", *lines])
    assert len(steps) == 5 and steps[3].num_decoding == 16 and steps[3].context == 300
    a, b = fit_overheads(steps, made_up_cost())
    assert (a, b) == (pytest.approx(3.0), pytest.approx(2.0))


def test_the_command_reports_the_hand_computed_latencies(tmp_path: Path) -> None:
    import json

    from tools.simulate import main

    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 4, "output_length": 7, "kind": "chat"},
        {"timestamp": 5, "input_length": 4, "output_length": 7, "tpot_slo_ms": 1.0},
        {"timestamp": 9000, "input_length": 4, "output_length": 7},  # past --duration
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    profile = tmp_path / "profile.json"
    made_up_cost().profile.save(profile)
    acceptance = chain_recording().save(tmp_path / "acceptance.json")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"vocab_size": 100, "max_position_embeddings": 64}')
    out = tmp_path / "out"
    argv = [
        "--trace", str(trace), "--profile", str(profile), "--acceptance", str(acceptance),
        "--target", str(target), "--out", str(out), "--drafts", "d", "--planner", "fixed",
        "--selector", "global-greedy", "--duration", "1", "--no-plots",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] == 2 and report["completed"] == 2
    # as in test_a_later_arrival_queues_then_shares_steps: E2E 0.034 s and 0.041 s
    assert report["e2e_s"]["mean"] == pytest.approx((0.034 + 0.041) / 2)
    assert report["slo_attainment"] == pytest.approx(0.5)  # the 1 ms objective is missed
    assert report["steps_by_draft"] == {"d": 4}
    assert report["meta"]["simulated"] is True


def test_the_command_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.simulate import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 4, "output_length": 7}\nnot json\n')
    argv = ["--trace", str(bad), "--out", str(tmp_path / "o"), "--profile", str(bad)]
    assert main(argv) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_a_request_ends_at_its_answers_length_not_at_its_cap() -> None:
    # the request carries a cap of 64 (what a client sends) and its answer has 7 tokens: the
    # steps commit 1 + 3 + 3, then the target's EOS ends it, which takes one more step here
    [record] = simulate(
        [SimRequest(0.0, num_prompt_tokens=4, num_output_tokens=7, kind="chat", max_tokens=64)]
    )
    assert record.num_output_tokens == 7 and record.finish_reason == "stop"
    assert [n for _, n in record.chunks] == [1, 3, 3]
    assert record.finish_s == pytest.approx(0.046)
    # an answer cut at the cap ends by length, as before
    [capped] = simulate([SimRequest(0.0, 4, 7, kind="chat", max_tokens=7)])
    assert capped.num_output_tokens == 7 and capped.finish_reason == "length"
    # EOS inside a step's committed tokens: 1 + 3, then 1 token and EOS
    [short] = simulate([SimRequest(0.0, 4, 5, kind="chat", max_tokens=64)])
    assert [n for _, n in short.chunks] == [1, 3, 1] and short.finish_reason == "stop"
    with pytest.raises(ValueError, match="below the answer"):
        SimRequest(0.0, 4, 7, max_tokens=6)
