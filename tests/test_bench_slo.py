"""The SLO experiments' pieces: AdaServe's class mix, the objectives, and the selectors on the
simulator doing what they are for (deterministic: a virtual clock, recorded acceptance)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench.scheduling.experiments import Machine
from bench.slo import experiments as ex
from bench.slo.reports import rates_markdown, urgent_markdown
from bench.slo.workloads import (
    CLASSES,
    Mix,
    Workload,
    sim_requests,
    trace_requests,
    urgent_share_mix,
)
from shared.scheduling.cost_model import CostModel, CostProfile
from tools.sim.acceptance import AcceptanceModel

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


@pytest.fixture(scope="module")
def workload() -> Workload:
    from transformers import AutoTokenizer

    from bench.scheduling.workloads import load_heldout
    from shared.model.model_set import target_dir

    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    return Workload(tokenizer, load_heldout(tokenizer))


@pytest.fixture(scope="module")
def gpu() -> Machine:
    path = PROFILES / "SmolLM2-135M-Instruct-cuda-nvidia-h100-80gb-hbm3-bfloat16-t0.json"
    return Machine("h100", CostModel(CostProfile.load(path)))


@pytest.fixture(scope="module")
def acceptance() -> AcceptanceModel:
    return AcceptanceModel.load(PROFILES / "acceptance-SmolLM2-135M-Instruct.json.gz")


def test_the_mix_draws_classes_by_their_shares_with_their_objectives(workload: Workload) -> None:
    requests = workload.requests(rate=2.0, count=400, baseline_ms=20.0, seed=1)
    counts = Counter(r.slo_class for r in requests)
    assert set(counts) == set(CLASSES)
    assert counts["urgent"] / 400 == pytest.approx(0.6, abs=0.07)
    assert {r.slo_class: r.tpot_slo_ms for r in requests} == {
        "urgent": 20.0,
        "standard": 48.0,
        "relaxed": 160.0,
    }
    for r in requests:
        if r.slo_class == "standard":  # summarization-like: long prompt, fixed answer
            assert r.kind == "summary" and r.num_output_tokens == Mix().summary_tokens
            assert abs(r.num_prompt_tokens - Mix().summary_prompt_tokens) <= 16
        else:
            assert r.kind == "chat" and r.num_output_tokens >= 1
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert requests == workload.requests(rate=2.0, count=400, baseline_ms=20.0, seed=1)
    sim, trace = sim_requests(requests), trace_requests(requests)
    assert [s.tpot_slo_ms for s in sim] == [t.tpot_slo_ms for t in trace]
    assert [t.slo_class for t in trace] == [r.slo_class for r in requests]


def test_the_urgent_share_sweep_keeps_the_other_two_even() -> None:
    assert urgent_share_mix(0.4).shares == pytest.approx((0.4, 0.3, 0.3))
    with pytest.raises(ValueError, match="urgent share"):
        urgent_share_mix(1.5)


def test_slo_aware_selection_meets_more_objectives_where_the_budget_is_free(
    workload: Workload, gpu: Machine, acceptance: AcceptanceModel
) -> None:
    """On the GPU profile a forward's tokens are free up to B: AdaServe attains at least what
    plain decoding and SpecInfer's static tree do, and urgent requests, which plain decoding
    cannot serve within one baseline step, are met by speculation."""
    setup = ex.Setup(gpu, acceptance, batch_size=16, requests=40, draws=1)
    row = ex.sweep(workload, setup, 16.0, Mix(), ("adaserve", "incremental", "static"))
    assert row["adaserve"]["attainment"] > row["incremental"]["attainment"] + 0.2
    assert row["adaserve"]["per_class"]["urgent"] > 0.5 > row["incremental"]["per_class"]["urgent"]
    assert row["adaserve"]["goodput_tok_s"] > row["static"]["goodput_tok_s"]
    table = rates_markdown(
        "h100",
        {
            "baseline_latency_ms": 21.5,
            "hardware_budget": 512,
            "step_overhead_ms": 0.0,
            "rates": {16.0: row},
            "verdict": ex.verdict({16.0: row}),
        },
    )
    assert any("adaserve" in line for line in table)
    assert urgent_markdown("h100", {"rate": 16.0, "shares": {0.6: row}})


def test_the_verdict_compares_with_the_best_baseline_where_one_still_attains_half() -> None:
    def row(ada: float, best: float, goodput: float) -> dict[str, Any]:
        summary = {"per_class": {}}
        return {
            "adaserve": {**summary, "attainment": ada, "goodput_tok_s": goodput},
            "goodput": {**summary, "attainment": best, "goodput_tok_s": 10.0},
            "incremental": {**summary, "attainment": best / 2, "goodput_tok_s": 5.0},
        }

    v = ex.verdict({1.0: row(0.9, 0.8, 20.0), 2.0: row(0.75, 0.5, 15.0), 4.0: row(0.4, 0.2, 9.0)})
    assert v["rate"] == 2.0 and v["attainment_ratio"] == pytest.approx(1.5)
    assert v["best_goodput_everywhere"] is False  # 9 < 10 at 4 req/s


def test_the_command_writes_results_tables_and_plots(tmp_path: Path) -> None:
    from bench.slo.__main__ import main

    profile = PROFILES / "SmolLM2-135M-Instruct-cuda-nvidia-h100-80gb-hbm3-bfloat16-t0.json"
    args = ["--requests", "8", "--draws", "1", "--selectors", "adaserve", "incremental"]
    args += ["--out", str(tmp_path), "--profile", str(profile)]
    assert main(["rates", "--rates", "16", *args]) == 0
    assert main(["urgent", "--rate", "16", "--shares", "0.2", "0.8", *args]) == 0
    stem = "cuda-nvidia-h100-80gb-hbm3-bfloat16-t0"
    rates = json.loads((tmp_path / f"rates-{stem}.json").read_text())
    assert set(rates["rates"]["16.0"]) == {"adaserve", "incremental"}
    assert rates["command"].startswith("python -m bench.slo")
    urgent = json.loads((tmp_path / f"urgent-{stem}.json").read_text())
    assert set(urgent["shares"]) == {"0.2", "0.8"}
    for name in (f"rates-{stem}", f"urgent-{stem}"):
        assert (tmp_path / f"{name}.md").read_text().startswith("###")
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_another_model_set_simulates_on_its_own_profiles_and_is_not_replayed() -> None:
    from bench.model_set_files import SET_FILES
    from bench.slo.__main__ import machines, parse_args
    from tools.sim.acceptance import beam_method

    args = parse_args(["rates", "--model-set", "qwen2.5-coder"])
    labels = [m.label for m in machines(args)]
    assert labels and all(not label.startswith("SmolLM2") for label in labels)
    assert any("cpu" in label for label in labels) and any("cuda" in label for label in labels)
    beams = AcceptanceModel.load(SET_FILES["qwen2.5-coder"].beams)
    recorded = AcceptanceModel.load(SET_FILES["qwen2.5-coder"].recording)
    assert beams.method == beam_method(8, 4) and set(beams.drafts) <= set(recorded.drafts)
    with pytest.raises(SystemExit):  # the services would serve SmolLM2
        parse_args(["real", "--model-set", "qwen2.5-coder"])


def test_requests_longer_than_a_recorded_text_keep_its_acceptance() -> None:
    """The SLO workload's answers outrun the qwen mixed recording's 96 tokens: replayed with
    its text, a request drafts nothing accepted past the text's end and decodes plainly from
    there; replayed without it (as bench.slo does), the recorded steps wrap round."""
    from bench.slo.workloads import SloRequest

    path = PROFILES / (
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M-cc324af070c2ecbf-cpu-intel-r-xeon-r-processor-"
        "bfloat16-t2.json"
    )
    machine = Machine("intel", CostModel(CostProfile.load(path)), 20.0)
    recorded = AcceptanceModel.load(
        PROFILES / "acceptance-Qwen2.5-Coder-1.5B-Instruct-mixed.json.gz"
    )
    requests = [SloRequest(0.0, "relaxed", 1e6, "chat", "", 40, 384, key) for key in range(3)]
    drafted = {}
    for label, model in (("text", recorded), ("steps", recorded.without_text())):
        assert model.has_text == (label == "text")
        setup = ex.Setup(machine, model, batch_size=4, draft=recorded.drafts[0], requests=3)
        records = ex.simulate_selector(requests, setup, "goodput")
        drafted[label] = sum(r.drafts for r in records) / sum(len(r.chunks) - 1 for r in records)
    assert drafted["text"] < 0.5 and drafted["steps"] > 0.9, drafted


def test_adaserve_replays_unpruned_beams(gpu: Machine, acceptance: AcceptanceModel) -> None:
    """The beam recording holds w = 4 nodes at each of d = 8 layers (nothing cut by path
    probability), so a shallower beam of width 4 shaped from it has 4 nodes at each of its
    layers (and one of depth 1, w nodes); the default recording, pruned at path probability
    0.2, cannot give AdaServe that."""
    from bench.model_set_files import SET_FILES
    from shared.values.methods import DraftMethod
    from tools.sim.acceptance import beam_method

    beams = AcceptanceModel.load(SET_FILES["smollm2"].beams)
    assert beams.method == beam_method(8, 4) and beams.method.min_path_prob == 0.0
    [session, *_] = [s for s in beams.sessions if s.kind == "chat" and s.draft == "draft-s"]
    shallow = DraftMethod("beam", depth=3, width=4, min_path_prob=0.0)
    narrow = DraftMethod("beam", depth=1, width=2, min_path_prob=0.0)
    full = [i for i, step in enumerate(session.steps) if len(step.parents) == 32]
    assert len(full) >= 0.8 * len(session.steps)
    for i in full:
        assert beams.drafted(session, i, 8, beams.method)[1] == (4,) * 8
        assert beams.drafted(session, i, 3, shallow)[1] == (4, 4, 4)
        assert beams.drafted(session, i, 8, narrow)[1] == (2,)
    pruned = [s for s in acceptance.sessions if s.kind == "chat" and s.draft == "draft-s"][0]
    sizes = [acceptance.drafted(pruned, i, 8, shallow)[0].num_nodes for i in range(20)]
    assert sum(sizes) < 20 * 13 / 2  # most pruned trees are smaller than the beam
    setup = ex.Setup(gpu, acceptance, beam_acceptance=beams)
    assert ex.acceptance_for(setup, "adaserve") is beams
    assert ex.acceptance_for(setup, "goodput") is acceptance
