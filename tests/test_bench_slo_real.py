"""The real SLO experiment's pure parts: the services' settings, the per-run summary, the
rankings and their agreement (no services are started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scheduling.real import policy_env, slug
from bench.slo.real import (
    agreement,
    describe,
    kendall_tau,
    kendall_tau_b,
    ranking,
    run_name,
    selector_env,
    spearman_rho,
    traceback_of,
)
from shared.settings import AugurySettings, LapsSettings
from tools.load.records import RequestRecord


def test_the_selector_and_the_running_set_are_set_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = selector_env("adaserve", 8)
    assert env == {
        "AUGURY_SCHEDULER__TREE_SELECTION": "adaserve",
        "AUGURY_SCHEDULER__MAX_RUNNING_REQUESTS": "8",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    scheduler = AugurySettings().scheduler  # what the services will read
    assert scheduler.tree_selection == "adaserve" and scheduler.max_running_requests == 8
    assert run_name(0.2, "thesis-slo") == "0.2-thesis-slo"


def test_the_policy_env_is_what_the_scheduling_replays_set() -> None:
    env = policy_env("lp-sjf/oracle", 1, LapsSettings())
    assert env["AUGURY_SCHEDULER__POLICY"] == "lp-sjf"
    assert env["AUGURY_SCHEDULER__LENGTH_PREDICTOR"] == "oracle"
    assert env["AUGURY_SCHEDULER__MAX_RUNNING_REQUESTS"] == "1"
    assert "AUGURY_SCHEDULER__LENGTH_PREDICTOR" not in policy_env("fcfs", 1, LapsSettings())
    assert slug("lp-sjf/oracle") == "lp-sjf-oracle" and slug("0.2-adaserve") == "0.2-adaserve"


def record(index: int, slo_class: str, slo_ms: float, tokens: int, seconds: float) -> RequestRecord:
    """A completed request: first token at 1 s, then `tokens - 1` more over `seconds`."""
    return RequestRecord(
        index=index,
        arrival_s=0.0,
        num_prompt_tokens=10,
        slo_class=slo_class,
        tpot_slo_ms=slo_ms,
        first_token_s=1.0,
        finish_s=1.0 + seconds,
        num_output_tokens=tokens,
        finish_reason="length",
    )


def test_a_failed_request_misses_its_objective_and_is_counted() -> None:
    met = record(0, "relaxed", 300.0, 11, 2.0)  # TPOT 200 ms
    missed = record(1, "urgent", 40.0, 11, 2.0)
    failed = RequestRecord(2, 0.0, 10, slo_class="urgent", tpot_slo_ms=40.0, error="boom")
    out = describe([met, missed, failed])
    assert out["attainment"] == pytest.approx(1 / 3)
    assert out["per_class"] == {"urgent": 0.0, "relaxed": 1.0}
    assert out["goodput_tok_s"] == pytest.approx(11 / 3.0)  # the met tokens over 0..3 s
    assert out["mean_tpot_ms"] == pytest.approx(200.0)
    assert out["per_class_mean_tpot_ms"] == {"urgent": pytest.approx(200.0), "relaxed": 200.0}
    assert out["failed"] == 1


def row(attainment: float, goodput: float, sim_attainment: float, sim_goodput: float) -> dict:
    return {
        "attainment": attainment,
        "goodput_tok_s": goodput,
        "sim_attainment": sim_attainment,
        "sim_goodput_tok_s": sim_goodput,
    }


def test_rankings_go_by_attainment_then_goodput() -> None:
    rows = {
        "a": row(0.5, 1.0, 0.2, 0.0),
        "b": row(0.5, 2.0, 0.2, 0.0),
        "c": row(0.9, 0.0, 0.2, 5.0),
    }
    assert ranking(rows) == ["c", "b", "a"]
    assert ranking(rows, "sim_") == ["c", "a", "b"]  # all tied on attainment; a, b by name


def test_rank_agreement() -> None:
    names = ["a", "b", "c", "d"]
    assert kendall_tau(names, names) == spearman_rho(names, names) == pytest.approx(1.0)
    assert kendall_tau(names, names[::-1]) == -1.0 and spearman_rho(names, names[::-1]) == -1.0
    swapped = ["b", "a", "c", "d"]  # one discordant pair of six
    assert kendall_tau(names, swapped) == pytest.approx(4 / 6)
    assert spearman_rho(names, swapped) == pytest.approx(1 - 6 * 2 / (4 * 15))
    assert kendall_tau(["a"], ["a"]) is None
    with pytest.raises(ValueError):
        kendall_tau(["a", "b"], ["a", "c"])


def test_tau_b_leaves_ties_tied() -> None:
    assert kendall_tau_b([0.1, 0.2, 0.3], [1.0, 2.0, 3.0]) == 1.0
    assert kendall_tau_b([0.1, 0.2, 0.3], [3.0, 2.0, 1.0]) == -1.0
    assert kendall_tau_b([0.5, 0.5, 0.5], [1.0, 2.0, 3.0]) is None  # no order to agree with
    # one tie on x: 2 of 3 pairs ordered by x, both concordant -> 2 / sqrt(2 * 3)
    assert kendall_tau_b([0.5, 0.5, 0.9], [1.0, 2.0, 3.0]) == pytest.approx(2 / 6**0.5)


def test_agreement_leaves_out_runs_that_crashed() -> None:
    rows = {
        "a": row(0.9, 1.0, 0.8, 1.0),
        "b": row(0.1, 1.0, 0.2, 1.0),
        "c": {"error": "RuntimeError: the services exited with 1"},
    }
    out = agreement(rows)
    assert out["ranking_real"] == out["ranking_sim"] == ["a", "b"]
    assert out["kendall_tau"] == pytest.approx(1.0) and out["spearman_rho"] == pytest.approx(1.0)
    assert out["attainment_tau_b"] == 1.0


def test_the_last_traceback_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(
        "INFO starting\nTraceback (most recent call last):\n  old\nValueError: old\n"
        "INFO again\nTraceback (most recent call last):\n  File x\nKeyError: 'new'\n"
    )
    assert traceback_of(log) == "Traceback (most recent call last):\n  File x\nKeyError: 'new'"
    assert traceback_of(tmp_path / "missing.log") is None
    (tmp_path / "clean.log").write_text("INFO fine\n")
    assert traceback_of(tmp_path / "clean.log") is None


def test_the_experiment_end_to_end_on_fake_services(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """real() with the services faked: every selector replays the same trace, a crashed run is
    reported with its traceback, and the simulator runs on the fitted overheads."""
    from contextlib import contextmanager

    from transformers import AutoTokenizer

    import bench.slo.real as slo_real
    from bench.scheduling.real import Running, Served
    from bench.scheduling.workloads import load_heldout
    from bench.slo.workloads import Workload
    from shared.model.model_set import target_dir
    from shared.scheduling.cost_model import CostModel, CostProfile
    from tools.sim.acceptance import AcceptanceModel

    profiles = Path(__file__).resolve().parent.parent / "profiles"
    cost = CostModel(CostProfile.load(sorted(profiles.glob("SmolLM2-135M-Instruct-cpu-*"))[0]))
    acceptance = AcceptanceModel.load(profiles / "acceptance-SmolLM2-135M-Instruct.json.gz")
    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    workload = Workload(tokenizer, load_heldout(tokenizer))
    logs = tmp_path / "logs"
    replayed: dict[str, list[float]] = {}

    @contextmanager
    def running(name: str, overrides: dict[str, str], **_: object):  # type: ignore[no-untyped-def]
        log = logs / f"{name}.log"
        logs.mkdir(exist_ok=True)
        if overrides["AUGURY_SCHEDULER__TREE_SELECTION"] == "static":
            log.write_text("Traceback (most recent call last):\nValueError: no tree\n")
            raise RuntimeError("the services exited with 1")
        log.write_text(
            "".join(
                f"DEBUG micro-batch {i}: {n} decoding ({n} tree nodes), 0 prefilling (0 tokens), "
                f"context 300; draft 5.0 ms, verify 60.0 ms, step {80 + 10 * n:.1f} ms\n"
                for i, n in enumerate([1, 2, 4, 8] * 5)
            )
        )
        yield Running("cell", "http://x", None, log)  # type: ignore[arg-type]

    async def published(cell: str) -> CostModel:
        return cost

    def replay_and_read(name, services, trace, timeout_s, *, strict):  # type: ignore[no-untyped-def]
        assert not strict
        replayed[name] = [t.arrival_s for t in trace]
        records = [
            RequestRecord(
                i, t.arrival_s, 10, kind=t.kind, slo_class=t.slo_class,
                tpot_slo_ms=t.tpot_slo_ms, first_token_s=t.arrival_s + 0.5,
                finish_s=t.arrival_s + 0.5 + 0.1 * (t.output_length - 1),
                num_output_tokens=t.output_length, finish_reason="length",
            )
            for i, t in enumerate(trace)
        ]  # fmt: skip
        records[0].error, records[0].finish_s = "boom", None
        return Served(records, {}, cost, services.log)

    monkeypatch.setattr(slo_real, "running", running)
    monkeypatch.setattr(slo_real, "published_cost", published)
    monkeypatch.setattr(slo_real, "replay_and_read", replay_and_read)
    lines: list[str] = []
    out = slo_real.real(
        ["adaserve", "static", "goodput"], [0.5], num_requests=4, batch_size=4,
        draft="draft-s", seed=0, timeout_s=60, out_dir=tmp_path / "out",
        acceptance=acceptance, progress=lines.append, workload=workload, logs=logs,
    )  # fmt: skip
    assert replayed["0.5-adaserve"] == replayed["0.5-goodput"]  # the same trace
    assert out["baseline_latency_ms"] == cost.baseline_latency_ms()
    assert out["failed_runs"] == ["0.5-static"] and out["failed_requests"] == 2
    row = out["rates"][0.5]
    assert row["selectors"]["static"]["traceback"].endswith("ValueError: no tree")
    assert sorted(row["ranking_real"]) == sorted(row["ranking_sim"]) == ["adaserve", "goodput"]
    for selector in ("adaserve", "goodput"):
        r = row["selectors"][selector]
        assert r["failed"] == 1 and r["sim_failed"] == 0 and 0 <= r["sim_attainment"] <= 1
        assert (tmp_path / "out" / "real" / "0.5" / selector / "records.jsonl").is_file()
    assert out["step_overhead_ms"] > 0 and out["calibration_steps"] == 40
    assert (tmp_path / "out" / "real" / "profile.json").is_file()
    assert len(lines) == 4  # a line per run and the simulated rate
