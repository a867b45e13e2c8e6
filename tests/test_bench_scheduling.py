"""The scheduling experiments' pieces: the committed labelled requests, and the policies on the
simulator doing what they are for (deterministic: a virtual clock, recorded acceptance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.scheduling import experiments as ex
from bench.scheduling.reports import markdown
from bench.scheduling.workloads import (
    HELDOUT,
    MAX_TOKENS,
    WORKLOADS,
    burst,
    draw,
    load_heldout,
    pool,
    sim_requests,
    trace_requests,
)
from shared.scheduling.cost_model import CostModel, CostProfile
from shared.settings import LapsSettings
from tools.sim.acceptance import AcceptanceModel

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


@pytest.fixture(scope="module")
def items() -> list[Any]:
    from transformers import AutoTokenizer

    from shared.model.model_set import target_dir

    return load_heldout(AutoTokenizer.from_pretrained(target_dir()))


@pytest.fixture(scope="module")
def machine() -> ex.Machine:
    path = sorted(PROFILES.glob("SmolLM2-135M-Instruct-cpu-*.json"))[0]
    return ex.Machine("cpu", CostModel(CostProfile.load(path)), step_overhead_ms=30.0)


@pytest.fixture(scope="module")
def acceptance() -> AcceptanceModel:
    return AcceptanceModel.load(PROFILES / "acceptance-SmolLM2-135M-Instruct.json.gz")


def test_the_labelled_requests_load_with_their_prompts(items: list[Any]) -> None:
    rows = HELDOUT.read_text().splitlines()
    assert len(items) == sum(1 for r in rows if '"num_output_tokens": 0' not in r) > 100
    assert {i.kind for i in items} == set(WORKLOADS["mix"])
    for item in items:
        assert item.prompt_ids and item.num_output_tokens >= 1
    chosen = draw(pool(items, "code"), 5, seed=3)
    assert chosen == draw(pool(items, "code"), 5, seed=3) and {i.kind for i in chosen} == {"code"}
    sim = sim_requests(chosen, burst(5))
    assert [r.prompt_tokens for r in sim] == [i.prompt_ids for i in chosen]
    assert [r.session_key for r in sim] == [i.index for i in chosen]
    trace = trace_requests(chosen, burst(5, 0.05))
    assert [t.num_output_tokens for t in trace] == [i.num_output_tokens for i in chosen]
    with pytest.raises(ValueError, match="unknown workload"):
        pool(items, "poetry")


def test_laps_sd_beats_fcfs_and_las_one_at_a_time(
    items: list[Any], machine: ex.Machine, acceptance: AcceptanceModel
) -> None:
    # ten chat requests arriving together, served one at a time (the paper's set-up): with
    # true lengths LAPS-SD is close to shortest-first, FCFS and LAS are not
    chosen = draw(pool(items, "chat"), 10, seed=10)
    means = {}
    for label in ("fcfs", "las", "laps-sd/oracle", "lp-sjf/oracle"):
        records = ex.simulate(
            chosen, burst(10), machine, acceptance, ex.BY_LABEL[label],
            batch_size=1, laps=LapsSettings(), draft="draft-s",
        )  # fmt: skip
        lengths = [r.num_output_tokens for r in records]
        assert lengths == [i.num_output_tokens for i in chosen]
        means[label] = ex.mean_latency_s(records)
    assert means["laps-sd/oracle"] < 0.9 * means["fcfs"]
    assert means["laps-sd/oracle"] < 0.9 * means["las"]
    assert means["lp-sjf/oracle"] < means["fcfs"]  # the upper bound it is measured against


def test_tables_render(items: list[Any], machine: ex.Machine, acceptance: AcceptanceModel) -> None:
    result = ex.paper(
        items, machine, acceptance,
        workloads=["code"], sizes=[3], draws=1, runs=[ex.BY_LABEL["fcfs"], ex.BY_LABEL["las"],
        ex.BY_LABEL["lp-sjf"], ex.BY_LABEL["laps-sd"]], laps=LapsSettings(), draft="draft-s",
        progress=lambda line: None,
    )  # fmt: skip
    table = markdown("paper", {"draws": 1, "machines": {"cpu": result}})
    assert "| code | 3 |" in table and "LAPS-SD vs LP-SJF" in table


def test_predictors_cannot_read_the_answers_length(
    items: list[Any], machine: ex.Machine, acceptance: AcceptanceModel, monkeypatch: Any
) -> None:
    import dataclasses

    from shared.scheduling.laps import OracleLength
    from shared.scheduling.lengths import LearnedLength

    # every experiment request carries the same cap, whatever its answer's length
    chosen = draw(pool(items, "mix"), 30, seed=4)
    assert {r.max_tokens for r in sim_requests(chosen, burst(30))} == {MAX_TOKENS}
    assert max(i.num_output_tokens for i in items) <= MAX_TOKENS
    # one prompt, answers of 2, 40 and 300 tokens: the learned predictor must predict the same
    # for all three (it reads the prompt, and max_tokens is no length); the oracle is told each
    prompt = pool(items, "chat")[0]
    same = [dataclasses.replace(prompt, num_output_tokens=n) for n in (2, 40, 300)]
    seen: dict[str, dict[str, float]] = {"learned": {}, "oracle": {}}
    for cls, name in ((LearnedLength, "learned"), (OracleLength, "oracle")):
        original = cls.predict

        def spy(self: Any, request: Any, _o: Any = original, _n: str = name) -> float:
            value = _o(self, request)
            seen[_n][request.request_id] = value
            return value

        monkeypatch.setattr(cls, "predict", spy)
    for label in ("lp-sjf", "lp-sjf/oracle"):
        records = ex.simulate(
            same, burst(3), machine, acceptance, ex.BY_LABEL[label],
            batch_size=1, laps=LapsSettings(), draft="draft-s",
        )  # fmt: skip
        assert [r.num_output_tokens for r in records] == [2, 40, 300]
    learned = [seen["learned"][f"sim-{i}"] for i in range(3)]
    assert learned[0] == learned[1] == learned[2] > 2
    assert [seen["oracle"][f"sim-{i}"] for i in range(3)] == [2, 40, 300]


def test_the_qwen_set_simulates_the_same_trace_on_its_own_profiles_and_recording() -> None:
    from bench.model_set_files import SET_FILES
    from bench.scheduling.__main__ import acceptance_model, machines, parse_args

    args = parse_args(["paper", "--model-set", "qwen2.5-coder"])
    assert SET_FILES["qwen2.5-coder"].recording.is_file()
    costs = [m.cost for m in machines(args)]
    assert costs and all(c.profile.target.key.model.startswith("Qwen2.5-Coder") for c in costs)
    acceptance = acceptance_model(args)
    assert args.draft == acceptance.drafts[0] and all(c.has_draft(args.draft) for c in costs)
    assert {"chat", "code", "math"} <= set(acceptance.kinds)  # every workload's kinds
    with pytest.raises(SystemExit):  # the engine and the services run SmolLM2
        parse_args(["real", "--model-set", "qwen2.5-coder"])
