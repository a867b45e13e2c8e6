"""The acceptance recording as the simulator reads it: a request follows one recorded prompt under
every draft, and a request whose draft changes continues that prompt's text where it had got to."""

from __future__ import annotations

from collections.abc import Sequence
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
from shared.scheduling.draft_choice import ChooserTraits
from shared.scheduling.request import RequestState
from shared.values.methods import DraftMethod
from tools.sim.acceptance import AcceptanceModel, RecordedStep, Session
from tools.sim.simulator import SimConfig, SimRequest, Simulator

RECORDING = Path(__file__).resolve().parent.parent / "profiles"
RECORDING /= "acceptance-SmolLM2-135M-Instruct-3drafts.json.gz"
CHAIN = DraftMethod("chain", k=2)


def chain_step(accepted: int) -> RecordedStep:
    return RecordedStep(parents=(0, 1), logq=(0.0, 0.0), accepted_node=accepted)


def session(
    kind: str, draft: str, prompt: int, accepted: Sequence[int], positions: Sequence[int] | None
) -> Session:
    steps = tuple(chain_step(a) for a in accepted)
    return Session(kind, draft, prompt, steps, None if positions is None else tuple(positions))


def two_drafts() -> AcceptanceModel:
    """Drafts a and b on the same two chat prompts and one code prompt; draft b also recorded a
    chat prompt that a did not. Sessions are listed out of prompt order on purpose."""
    return AcceptanceModel(
        "t",
        CHAIN,
        [
            session("chat", "a", 1, [2, 2], None),
            session("chat", "a", 0, [2, 2, 2, 2], [1, 4, 7, 10]),
            session("code", "a", 0, [0], None),
            session("chat", "b", 0, [1] * 6, [1, 3, 5, 7, 9, 11]),
            session("chat", "b", 2, [1], None),
            session("chat", "b", 1, [0, 0], None),
            session("code", "b", 0, [1], None),
        ],
    )


def test_a_request_key_follows_the_same_prompt_under_every_draft() -> None:
    model = two_drafts()
    seen = set()
    for key in range(40):
        prompt = model.prompt_for("chat", key)
        assert prompt in {("chat", 0), ("chat", 1)}  # chat 2 was not recorded with draft a
        seen.add(prompt)
        for draft in ("a", "b"):
            chosen = model.session_for("chat", draft, key, prompt)
            assert (chosen.kind, chosen.draft, chosen.prompt) == ("chat", draft, prompt[1])
    assert seen == {("chat", 0), ("chat", 1)}
    # a kind no draft recorded: a prompt of any kind that all of them recorded
    assert {model.prompt_for("poetry", k) for k in range(40)} <= {
        ("chat", 0),
        ("chat", 1),
        ("code", 0),
    }
    assert model.prompt_for(None, 3) is not None
    assert model.prompt_for("chat", 3, drafts=()) is None


def test_with_one_draft_the_prompt_is_the_session_it_always_picked() -> None:
    model = two_drafts()
    for draft in ("a", "b"):
        for kind in ("chat", "code", "poetry", None):
            for key in range(30):
                prompt = model.prompt_for(kind, key, drafts=[draft])
                unaligned = model.session_for(kind, draft, key)
                assert model.session_for(kind, draft, key, prompt) is unaligned


def test_a_prompt_the_draft_did_not_record_falls_back_to_the_key() -> None:
    model = two_drafts()
    assert model.session_for("chat", "a", 5, ("chat", 2)) is model.session_for("chat", "a", 5)


def test_steps_follow_the_text_and_wrap_round() -> None:
    counted = session("chat", "a", 0, [2, 0, 1], None)  # no positions: counted from the steps
    assert counted.starts == (1, 4, 5)
    gaps = session("chat", "a", 0, [2, 0, 1], [1, 6, 9])  # steps that drafted nothing between
    for s in (counted, gaps):
        at, steps = 0, []
        for _ in range(7):
            step = s.step_at(at)
            steps.append(step)
            at = s.end_of(step)
        assert steps == [0, 1, 2, 0, 1, 2, 0]
    assert gaps.step_at(4) == 1 and gaps.step_at(7) == 2 and gaps.step_at(10) == 0


def test_positions_and_text_round_trip_and_are_checked(tmp_path: Path) -> None:
    recorded = Session("chat", "a", 0, (chain_step(2), chain_step(1)), (1, 5), 9, 1234)
    model = AcceptanceModel("t", CHAIN, [recorded, session("chat", "b", 0, [1], None)])
    loaded = AcceptanceModel.load(model.save(tmp_path / "a.json.gz"))
    assert loaded.sessions == model.sessions
    assert loaded.sessions[1].positions is None and loaded.sessions[1].starts == (1,)
    data = model.to_json()
    data["sessions"][0]["positions"] = [1, 3]  # the first step committed 3 tokens: 1 + 3 > 3
    with pytest.raises(ValueError, match="positions"):
        AcceptanceModel.from_json(data)


def flat_profile(ms: float, name: str) -> ModelProfile:
    key = ProfileKey(model=name, fingerprint="f", device="cpu: test", dtype="float32", threads=1)
    curve = ForwardCurve(tokens=[1, 1024], contexts=[0], ms_grid=[[ms], [ms]])
    return ModelProfile(key=key, curve=curve)


class Alternate(ChooserTraits):
    """Draft a, then b, then a, ... for every request, step by step."""

    name = "alternate"
    learns = False

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def assign(
        self, requests: Sequence[RequestState], live_models: Sequence[str], cost: object
    ) -> dict[str, str]:
        out = {}
        for r in requests:
            n = self.steps.get(r.request_id, 0)
            self.steps[r.request_id] = n + 1
            out[r.request_id] = ("a", "b")[n % 2]
        return out

    def observe(self, outcome: object) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def test_a_request_whose_draft_changes_continues_the_same_text() -> None:
    drafts = {"a": flat_profile(1.0, "a"), "b": flat_profile(1.0, "b")}
    cost = CostModel(CostProfile(target=flat_profile(10.0, "t"), drafts=drafts))
    config = SimConfig(
        SchedulerConfig(planner="fixed", tree_selection="global-greedy"), drafts=("a", "b")
    )
    sim = Simulator(config, cost, two_drafts())
    sim.core.chooser = Alternate()
    calls: list[tuple[str, str, int, int]] = []
    session_step = sim._session_step

    def spy(rid: str, model: str) -> tuple[Session, int]:
        chosen, step = session_step(rid, model)
        calls.append((rid, chosen.draft, chosen.prompt, step))
        return chosen, step

    sim._session_step = spy  # type: ignore[method-assign]
    requests = [SimRequest(0.0, 4, 40, kind="chat", session_key=k) for k in range(6)]
    records = sim.run(requests)
    assert all(r.is_completed for r in records)
    by_request: dict[str, list[tuple[str, int, int]]] = {}
    for rid, draft, prompt, step in calls:
        by_request.setdefault(rid, []).append((draft, prompt, step))
    prompts = {rid: {p for _, p, _ in seen} for rid, seen in by_request.items()}
    assert all(len(p) == 1 for p in prompts.values())  # one prompt under both drafts
    assert {p for ps in prompts.values() for p in ps} == {0, 1}
    for seen in by_request.values():
        assert [d for d, _, _ in seen[:4]] == ["a", "b", "a", "b"]
        if seen[0][1] == 0:
            # a's step 0 ends at token 4; b's first step from there starts at 5 (its step 2) and
            # ends at 7, where a's step 2 starts; it ends at 10, b's step 5 starts at 11; then
            # past a's last step the text starts over
            assert [s for _, _, s in seen[:5]] == [0, 2, 2, 5, 0]


def test_the_committed_recording_has_every_draft_on_the_same_texts() -> None:
    model = AcceptanceModel.load(RECORDING)
    assert model.drafts == ["draft-l", "draft-m", "draft-s"]
    assert model.kinds == ["chat", "code", "math"]
    texts: dict[tuple[str, int], set[tuple[int | None, int | None]]] = {}
    for s in model.sessions:
        texts.setdefault((s.kind, s.prompt), set()).add((s.num_tokens, s.output_crc))
    assert len(texts) == 3 * 8
    # greedy decoding with the same target: the draft does not change the text
    assert all(len(t) == 1 for t in texts.values())
    for key in range(24):
        prompt = model.prompt_for("code", key)
        chosen = {model.session_for("code", d, key, prompt) for d in model.drafts}
        assert {(s.kind, s.prompt) for s in chosen} == {prompt}
