"""`python -m bench.drafters`: the Fig. 11 experiment on a small setup, and its oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.drafters.__main__ import RECORDING, main
from bench.drafters.experiments import KINDS, Setup, chooser_runs, fig11, per_request_best
from shared.scheduling.cost_model import CostModel, CostProfile
from shared.settings import LbssSettings
from tools.load.records import RequestRecord
from tools.sim.acceptance import AcceptanceModel

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
H100 = PROFILES / "SmolLM2-135M-Instruct-cuda-nvidia-h100-80gb-hbm3-bfloat16-t0.json"
DRAFTS = ("draft-s", "draft-m", "draft-l")


def record(index: int, first: float, finish: float, tokens: int = 11) -> RequestRecord:
    return RequestRecord(
        index, 0.0, 4, first_token_s=first, finish_s=finish, num_output_tokens=tokens
    )


def test_the_oracle_takes_each_requests_fastest_draft() -> None:
    fixed = {
        "draft-s": [record(0, 0.0, 1.0), record(1, 0.0, 4.0)],
        "draft-l": [record(0, 0.0, 2.0), record(1, 0.5, 2.5)],
    }
    assert per_request_best(fixed) == {"sim-0": "draft-s", "sim-1": "draft-l"}


def test_every_chooser_serves_every_workload_and_lbss_reports_where_it_settled() -> None:
    setup = Setup(
        CostModel(CostProfile.load(H100)),
        AcceptanceModel.load(RECORDING),
        batch_size=4,
        max_tokens=24,
        lbss=LbssSettings(alpha=4, beta=2),
    )
    lengths = {kind: [40, 60, 80, 100] for kind in KINDS}
    results = fig11(setup, lengths, DRAFTS, say=lambda _: None)
    assert [r.kind for r in results] == list(KINDS)
    labels = [run.label for run in chooser_runs(DRAFTS)]
    for result in results:
        assert list(result.goodput) == labels and all(g > 0 for g in result.goodput.values())
        assert sum(result.settled["lbss"].values()) == 4  # every request drafted somewhere
        assert sum(result.oracle.values()) == 4
    # the three fixed runs differ: the drafts really are different arms
    chat = results[0].goodput
    assert len({round(chat[f"fixed {d}"], 3) for d in DRAFTS}) == 3


def test_the_command_writes_its_table(tmp_path: Path, monkeypatch) -> None:
    import bench.drafters.__main__ as cli

    monkeypatch.setattr(cli, "prompt_lengths", lambda per_kind: {k: [50] * 2 for k in KINDS})
    assert (
        main(
            [
                "fig11",
                "--copies",
                "1",
                "--max-tokens",
                "16",
                "--batch-size",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    [table] = tmp_path.glob("fig11-*.md")
    assert "| chat |" in table.read_text() and "LBSS / oracle" in table.read_text()


def test_fig13_marks_the_best_count_and_the_heuristics_goodput(tmp_path: Path, monkeypatch) -> None:
    import bench.drafters.__main__ as cli

    monkeypatch.setattr(cli, "prompt_lengths", lambda per_kind: {k: [50] * 2 for k in KINDS})
    argv = ["fig13", "--copies", "2", "--max-tokens", "16", "--batch-size", "4"]
    assert main([*argv, "--max-micro-batches", "3", "--out", str(tmp_path)]) == 0
    [table] = tmp_path.glob("fig13-*.md")
    text = table.read_text()
    assert "| M=1 | M=2 | M=3 | auto |" in text and text.count("(best)") == 3


def test_real_runs_serve_each_fixed_draft_alone_and_count_where_requests_settled() -> None:
    import json

    from bench.drafters.real import real_runs, run_env, settled

    runs = real_runs(DRAFTS, ["fixed", "lbss", "lbss+fast", "lbss+pruned"], prune_z=1.5)
    labels = ["fixed draft-s", "fixed draft-m", "fixed draft-l", "lbss", "lbss+fast"]
    labels.append("lbss+pruned")
    assert [r.label for r in runs] == labels
    assert runs[1].drafts == ("draft-m",) and runs[3].drafts == tuple(DRAFTS)
    env = run_env(runs[1], 8, "fixed")
    assert json.loads(env["AUGURY_MODELS__MODEL_FREE"]) == []  # none named: none served
    assert env["AUGURY_SCHEDULER__DRAFT_CHOOSER"] == "fixed"
    assert env["AUGURY_SCHEDULER__FAST_SWITCHING"] == "false"
    fast = run_env(runs[4], 8, "fixed")
    assert fast["AUGURY_SCHEDULER__DRAFT_CHOOSER"] == "lbss"
    assert fast["AUGURY_SCHEDULER__FAST_SWITCHING"] == "true"
    assert fast["AUGURY_SCHEDULER__LBSS__PRUNE_Z"] == "0.0"  # Spin's exploration
    pruned = run_env(runs[5], 8, "fixed")
    assert pruned["AUGURY_SCHEDULER__DRAFT_CHOOSER"] == "lbss"
    assert pruned["AUGURY_SCHEDULER__LBSS__PRUNE_Z"] == "1.5"
    assert pruned["AUGURY_SCHEDULER__FAST_SWITCHING"] == "false"
    assert env["AUGURY_SCHEDULER__SPECULATION__PLANNER"] == "fixed"
    assert [d["name"] for d in json.loads(env["AUGURY_MODELS__DRAFTS"])] == ["draft-m"]
    a, b, c = (RequestRecord(i, 0.0, 4, kind=k) for i, k in enumerate(["chat", "chat", "code"]))
    a.steps_by_draft, b.steps_by_draft = {"draft-s": 3, "draft-l": 5}, {"draft-s": 4}
    assert settled([a, b, c]) == {"chat": {"draft-l": 1, "draft-s": 1}}


def test_real_runs_serve_model_free_drafts_as_such_and_the_default_merges_them() -> None:
    import json

    from bench.drafters.real import DEFAULT_RUN, real_runs, run_env

    drafts = ["ngram", "draft-s"]
    runs = real_runs(drafts, ["fixed", DEFAULT_RUN, "counterfactual"], prune_z=0.0)
    assert [r.label for r in runs] == ["fixed ngram", "fixed draft-s", "default", "counterfactual"]
    alone = run_env(runs[0], 8, "goodput", target_dtype="bfloat16")
    assert json.loads(alone["AUGURY_MODELS__MODEL_FREE"]) == ["ngram"]
    assert json.loads(alone["AUGURY_MODELS__DRAFTS"]) == []
    assert alone["AUGURY_ENGINE__TARGET_DTYPE"] == "bfloat16"
    # the default: `fixed` on the model draft, the copy merged beside it
    default = run_env(runs[2], 8, "goodput")
    assert default["AUGURY_SCHEDULER__DRAFT_CHOOSER"] == "fixed"
    assert runs[2].drafts == ("draft-s", "ngram")
    assert [d["name"] for d in json.loads(default["AUGURY_MODELS__DRAFTS"])] == ["draft-s"]
    assert json.loads(default["AUGURY_MODELS__MODEL_FREE"]) == ["ngram"]
    assert "AUGURY_ENGINE__TARGET_DTYPE" not in default


def test_a_kinds_trace_takes_the_kinds_in_turn() -> None:
    from bench.drafters.real import kinds_trace

    trace = kinds_trace(["code-edit", "chat"], 2, 32)
    assert [t.kind for t in trace] == ["code-edit", "chat", "code-edit", "chat"]
    assert all(t.output_length == 32 and t.messages for t in trace)
    assert [t.arrival_s for t in trace] == [0.0, 0.05, 0.1, pytest.approx(0.15)]
    assert trace[0].messages != trace[2].messages


def test_the_per_request_best_is_no_bound_and_the_batch_aware_oracle_beats_it() -> None:
    """Fig. 11's set-up on the H100 profile, chat: each request on the draft it decoded fastest
    with alone is slower than every request on the best fixed draft (a step waits for its
    slowest drafter), so that assignment is no upper bound; the batch-aware oracle prices the
    shared steps in and is at least the best of both."""
    from bench.drafters.__main__ import prompt_lengths
    from bench.drafters.experiments import (
        ChooserRun,
        batch_aware_oracle,
        goodput_tps,
        simulate,
        workload,
    )

    setup = Setup(CostModel(CostProfile.load(H100)), AcceptanceModel.load(RECORDING))
    requests = workload("chat", prompt_lengths(8)["chat"], setup.max_tokens, copies=2)
    fixed = {d: simulate(setup, requests, ChooserRun(d, "fixed", (d,))) for d in DRAFTS}
    best_fixed = max(goodput_tps(records) for records in fixed.values())
    each = per_request_best(fixed)
    run = ChooserRun("oracle", "oracle", DRAFTS)
    per_request = goodput_tps(simulate(setup, requests, run, each))
    assert per_request < 0.95 * best_fixed
    everyone = [{f"sim-{i}": d for i in range(len(requests))} for d in DRAFTS]
    chosen, oracle = batch_aware_oracle(setup, requests, DRAFTS, [*everyone, each], passes=1)
    assert oracle >= best_fixed and oracle > per_request
    assert goodput_tps(simulate(setup, requests, run, chosen)) == oracle
