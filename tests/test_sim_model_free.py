"""Model-free drafts in the simulator: what it accepts step by step equals what the real engine's
verification accepted on the same requests (greedy, the tiny target), and the counterfactual
chooser moves copying requests to the draft that copies; the oracle of static assignments and
the mixed experiment's bounded form."""

from __future__ import annotations

import pytest

from bench.drafters.__main__ import MIXED_RECORDING
from bench.drafters.__main__ import PROFILE as MIXED_PROFILE
from bench.drafters.experiments import (
    ChooserRun,
    Setup,
    batch_aware_oracle,
    goodput_tps,
    simulate,
)
from bench.drafters.mixed import COUNTERFACTUAL, ORACLE, PLAIN, mixed, mixed_requests, mixed_table
from shared.engine.model_free import ModelFreeDrafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.model_set import REPO_ROOT
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import CostModel, CostProfile
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.tree import counterfactual_accepted, merge_trees
from tests.test_model_free_engine import COPY_PROMPTS
from tests.test_simulator import made_up_cost
from tools.sim.acceptance import AcceptanceModel, RecordedStep, Session
from tools.sim.simulator import SimConfig, SimRequest, Simulator

MAX_TOKENS = 60
PROFILES = REPO_ROOT / "profiles"
QWEN_MIXED_RECORDING = PROFILES / "acceptance-Qwen2.5-Coder-1.5B-Instruct-mixed.json.gz"
QWEN_PROFILE = next(PROFILES.glob("Qwen2.5-Coder-1.5B-Instruct-*-cpu-intel-*-bfloat16-t2.json"))
CHAIN = DraftMethod("chain", k=2)
SCHEDULER = SchedulerConfig(planner="fixed", tree_selection="global-greedy")


@pytest.fixture(scope="module")
def engine_steps(tiny_target_dir) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's output and its tokens committed per decode step, from the real engine
    with `ngram` drafting every step and every tree verified whole."""
    committed: dict[str, list[int]] = {}

    def observe(batch, results) -> None:
        for request in batch.decode:
            result = results[request.request_id]
            committed.setdefault(request.request_id, []).append(result.num_accepted + 1)

    runner = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=2 << 20)
    engine = SpecEngine(
        Verifier(runner), ModelFreeDrafter("ngram"), CHAIN, SCHEDULER, observer=observe
    )
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in COPY_PROMPTS]
    while engine.has_unfinished():
        engine.step()
    outputs = [list(engine.requests[rid].output) for rid in ids]
    return outputs, [committed[rid] for rid in ids]


def text_recording(outputs: list[list[int]]) -> AcceptanceModel:
    """Each prompt as a kind of its own with its recorded output; one step of a model draft
    `d` that the model-free runs never use."""
    step = RecordedStep(parents=(0,), logq=(0.0,), accepted_node=0)
    sessions = [
        Session(f"copy{i}", "d", 0, (step,), prompt_tokens=tuple(p), output_tokens=tuple(o))
        for i, (p, o) in enumerate(zip(COPY_PROMPTS, outputs, strict=True))
    ]
    return AcceptanceModel("t", CHAIN, sessions)


def requests(outputs: list[list[int]]) -> list[SimRequest]:
    return [
        SimRequest(
            0.0, len(p), len(o), kind=f"copy{i}", session_key=0, max_tokens=MAX_TOKENS, app="a"
        )
        for i, (p, o) in enumerate(zip(COPY_PROMPTS, outputs, strict=True))
    ]


def test_ngram_accepts_in_the_simulator_what_the_engine_accepted(engine_steps) -> None:
    outputs, steps = engine_steps
    assert sum(n - 1 for s in steps for n in s) >= 40  # the tiny target's output repeats: copied
    config = SimConfig(SCHEDULER, drafts=("ngram",), method=CHAIN)
    records = Simulator(config, made_up_cost(), text_recording(outputs)).run(requests(outputs))
    for record, output, engine in zip(records, outputs, steps, strict=True):
        assert record.num_output_tokens == len(output)
        # the first chunk is the prefill's token; then one chunk per decode step
        assert [n for _, n in record.chunks[1:]] == engine
        assert record.accepted_tokens == sum(n - 1 for n in engine)


def test_counterfactual_chooser_moves_copying_requests_to_ngram(engine_steps) -> None:
    """Beside a model draft that the recording says never accepts anything, the counterfactual
    chooser scores ngram on the model's steps and then drafts most steps with it."""
    outputs, _ = engine_steps
    scheduler = SchedulerConfig(draft_chooser="counterfactual", tree_selection="global-greedy")
    config = SimConfig(scheduler, drafts=("d", "ngram"), method=CHAIN)
    sim = Simulator(config, made_up_cost(), text_recording(outputs))
    records = sim.run(requests(outputs))
    assert sim.core.counterfactual_stats["ngram"].num_target_forwards > 0
    for record in records:
        assert record.num_output_tokens == len(outputs[record.index])
        assert record.steps_by_draft.get("ngram", 0) > record.steps_by_draft.get("d", 0)


# ---- the oracle of static assignments, and the mixed experiment's bounded form -------------------


def test_best_static_assignment_is_reproducible_and_beats_every_start(engine_steps) -> None:
    """The oracle's goodput is what simulating its assignment gives, and at least that of every
    fixed draft and every start it was given (a request put on the model draft alone)."""
    outputs, _ = engine_steps
    setup = Setup(made_up_cost(), text_recording(outputs), batch_size=2, max_tokens=MAX_TOKENS)
    reqs = requests(outputs)
    ids = [f"sim-{i}" for i in range(len(reqs))]
    fixed = {d: {rid: d for rid in ids} for d in ("d", "ngram")}
    mixed_start = {rid: "d" if i == 0 else "ngram" for i, rid in enumerate(ids)}
    best, goodput = batch_aware_oracle(setup, reqs, ("d", "ngram"), [*fixed.values(), mixed_start])
    oracle = ChooserRun("oracle", "oracle", ("d", "ngram"))
    assert goodput_tps(simulate(setup, reqs, oracle, best)) == pytest.approx(goodput)
    for start in (*fixed.values(), mixed_start):
        assert goodput >= goodput_tps(simulate(setup, reqs, oracle, start))
    assert best == fixed["ngram"]  # the model draft accepts nothing here: nobody should keep it


def test_mixed_experiment_reports_ratios_and_histograms(engine_steps) -> None:
    outputs, _ = engine_steps
    setup = Setup(made_up_cost(), text_recording(outputs), batch_size=2, max_tokens=MAX_TOKENS)
    result = mixed(setup, requests(outputs), ("d", "ngram"), oracle_passes=1, say=lambda _: None)
    assert result.best_fixed == "fixed ngram"
    assert result.default == "d + ngram merged"
    assert set(result.goodput) == {
        PLAIN, "fixed d", "fixed ngram", "d + ngram merged", "eps-greedy", "lbss", COUNTERFACTUAL,
        ORACLE,
    }  # fmt: skip
    compared = ("d + ngram merged", COUNTERFACTUAL)
    assert set(result.ratios()) == (
        {f"{name} / {base}" for name in compared for base in ("best fixed", "oracle")}
        | {f"{name} / plain" for name in ("fixed ngram", *compared)}
        | {"oracle / best fixed"}
    )
    assert result.ratios()["fixed ngram / plain"] > 1.5  # the tiny target's answers repeat
    assert result.goodput[ORACLE] >= result.goodput["fixed ngram"]
    for kind in ("copy0", "copy1", "copy2"):
        assert result.histogram[COUNTERFACTUAL][kind] == {"ngram": 1}
    table = mixed_table(result, ("d", "ngram"))
    assert "counterfactual / oracle" in table and "| d + ngram merged |" in table


# the committed mixed recordings: (recording, a cost profile that prices its draft, the draft)
MIXED = {
    "smollm2": (MIXED_RECORDING, MIXED_PROFILE, "draft-s"),
    "qwen2.5-coder": (QWEN_MIXED_RECORDING, QWEN_PROFILE, "qwen2.5-coder-0.5b"),
}


@pytest.mark.parametrize("model_set", list(MIXED))
def test_mixed_requests_replay_their_own_recorded_text(model_set: str) -> None:
    """Each request of a committed mixed recording follows the prompt whose text it carries:
    the simulator replays that prompt and answer, and the request ends at the answer's end."""
    path, profile, draft = MIXED[model_set]
    recording = AcceptanceModel.load(path)
    reqs = mixed_requests(recording, max_tokens=64, per_kind=1)
    assert {r.kind for r in reqs} == {"chat", "code-edit", "revision", "passage-qa", "agent"}
    sim = Simulator(
        SimConfig(SchedulerConfig(max_running_requests=8), drafts=(draft, "ngram")),
        CostModel(CostProfile.load(profile)),
        recording,
    )
    records = sim.run(reqs)
    for i, (request, record) in enumerate(zip(reqs, records, strict=True)):
        prompt, output = sim._texts[f"sim-{i}"]
        assert prompt == request.prompt_tokens
        assert len(output) >= request.num_output_tokens == record.num_output_tokens


@pytest.mark.parametrize("model_set", list(MIXED))
def test_a_model_draft_replays_its_recorded_run_step_for_step(model_set: str) -> None:
    """With its whole tree verified every step, a request on the draft that made the recording
    commits what the recorded run committed at every step: the recorded step's accepted path
    and bonus where the run drafted, one token where it drafted nothing."""
    path, profile, draft = MIXED[model_set]
    recording = AcceptanceModel.load(path)
    for request in mixed_requests(recording, max_tokens=96, per_kind=2):
        sim = Simulator(
            SimConfig(SCHEDULER, drafts=(draft,)),
            CostModel(CostProfile.load(profile)),
            recording,
        )
        [record] = sim.run([request])
        session = sim._sessions[("sim-0", draft)]
        at, expected = 1, []
        while at < request.num_output_tokens:
            index = session.step_at(at)
            drafted = session.starts[index] == at
            expected.append(1 + len(session.steps[index].accepted_path()) if drafted else 1)
            at += expected[-1]
        got = [n for _, n in record.chunks[1:]]
        assert got[:-1] == expected[:-1] and got[-1] <= expected[-1]  # the last one at the end


# ---- merged trees: a model draft's and a model-free draft's, as the default configuration ------


class _MergeWatcher(Simulator):
    """Records, for every verified merged tree, what the model's own tree, the model-free
    partner's and the merged tree as selected accept of the recorded text, and whether the
    selector kept the whole union."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.accepted: list[tuple[int, int, int, bool]] = []

    def verify(self, batch, entries):
        for entry in entries:
            rid = entry.request_id
            if entry.tree is None or rid not in batch.own_trees:
                continue
            text = self._texts[rid][1][len(self.core.requests[rid].output) :]
            own, partner = batch.own_trees[rid], batch.model_free_trees[rid]
            whole = merge_trees([own, partner]).num_nodes == entry.tree.num_nodes
            own_n, partner_n, merged_n = (
                counterfactual_accepted(t, text)[0] for t in (own, partner, entry.tree)
            )
            self.accepted.append((own_n, partner_n, merged_n, whole))
        return super().verify(batch, entries)


def test_a_merged_tree_accepts_the_longer_of_its_model_and_model_free_parts() -> None:
    """The simulator merges a model-free draft's tree into the model draft's (`merge_drafts`
    auto): a merged step accepts the longer of what each part accepts of the recorded text
    where the selector kept the whole union (never more where it cut some), both parts carry
    steps the other would not, and every request still commits its recorded answer."""
    recording = AcceptanceModel.load(MIXED_RECORDING)
    reqs = mixed_requests(recording, max_tokens=64, per_kind=2)
    sim = _MergeWatcher(
        SimConfig(SCHEDULER.model_copy(update={"max_running_requests": 8}),
                  drafts=("draft-s", "ngram")),
        CostModel(CostProfile.load(MIXED_PROFILE)),
        recording,
    )  # fmt: skip
    records = sim.run(reqs)
    assert sim.core.num_merged_trees == len(sim.accepted)
    assert sum(whole for *_, whole in sim.accepted) > 100
    for own, partner, merged, whole in sim.accepted:
        assert merged == max(own, partner) if whole else merged <= max(own, partner)
    assert any(own > partner for own, partner, *_ in sim.accepted)
    assert any(partner > own for own, partner, *_ in sim.accepted)
    for request, record in zip(reqs, records, strict=True):
        assert record.num_output_tokens == request.num_output_tokens
