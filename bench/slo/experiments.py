"""The SLO experiments on the simulator: every tree selector under AdaServe's class mix.

Every run is the real scheduler core with the named selector (`shared.scheduling.slo`,
`shared.scheduling.tree_selection`) on a virtual clock whose step times come from a cost profile
and whose acceptance replays recorded sessions (`tools.sim`). Two experiments:

- `rates`: AdaServe's Fig. 4-5. The request rate swept from light to overload: SLO attainment
  (share of requests whose TPOT met their class's objective) and goodput (output tokens per
  second of the requests that met it) of each selector, averaged over draws of the trace.
- `urgent`: its Fig. 6. At one rate, the urgent share from 20% to 80%.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.scheduling.experiments import Machine
from bench.slo.workloads import CLASSES, Mix, SloRequest, Workload, sim_requests, urgent_share_mix
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import BASELINE_BATCH
from shared.settings import SloSettings
from tools.load.records import RequestRecord, meets_slo
from tools.load.report import run_duration_s
from tools.sim.acceptance import AcceptanceModel
from tools.sim.simulator import SimConfig, Simulator, step_overhead_ms

SELECTORS = (
    "adaserve",
    "thesis-slo",
    "goodput",
    "global-greedy",
    "equal-greedy",
    "static",
    "incremental",
)
BASELINES = tuple(s for s in SELECTORS if s not in ("adaserve", "thesis-slo"))

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Setup:
    """What every run of an experiment shares."""

    machine: Machine
    acceptance: AcceptanceModel
    batch_size: int = 16
    draft: str = "draft-s"
    slo: SloSettings = field(default_factory=SloSettings)
    requests: int = 120
    draws: int = 3
    # AdaServe's candidates replayed from unpruned beams (`python -m tools.sim.acceptance
    # --beam 8 4`): the default recording holds only the nodes a dynamic tree kept over its
    # min_path_prob, so a beam shaped from it has about 1.4 nodes. None: that recording.
    beam_acceptance: AcceptanceModel | None = None


def acceptance_for(setup: Setup, selector: str) -> AcceptanceModel:
    """The recording a selector's candidates replay: AdaServe's beams from the beam recording."""
    if selector == "adaserve" and setup.beam_acceptance is not None:
        return setup.beam_acceptance
    return setup.acceptance


def baseline_latency_ms(machine: Machine) -> float:
    """AdaServe's baseline latency as their system measures it: a plain-decoding step at batch 8
    from the profile, plus the time a step spends outside the forwards (on a CPU machine)."""
    overhead = step_overhead_ms(
        machine.step_overhead_ms, machine.request_overhead_ms, BASELINE_BATCH
    )
    return machine.cost.baseline_latency_ms(BASELINE_BATCH) + overhead


def simulate_selector(
    requests: Sequence[SloRequest], setup: Setup, selector: str
) -> list[RequestRecord]:
    config = SimConfig(
        SchedulerConfig(
            max_running_requests=setup.batch_size, tree_selection=selector, slo=setup.slo
        ),
        drafts=(setup.draft,),
        shared_device=setup.machine.shared_device,
        step_overhead_ms=setup.machine.step_overhead_ms,
        request_overhead_ms=setup.machine.request_overhead_ms,
    )
    acceptance = acceptance_for(setup, selector)
    records = Simulator(config, setup.machine.cost, acceptance).run(sim_requests(requests))
    failed = [r for r in records if not r.is_completed]
    if failed:
        raise RuntimeError(
            f"{selector}: {len(failed)} simulated requests failed: {failed[0].error}"
        )
    return records


def slo_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """SLO attainment overall and per class, and goodput (tokens/s of requests that met it)."""
    duration = run_duration_s(records) or 0.0
    met = [r for r in records if meets_slo(r)]
    per_class = {}
    for name in CLASSES:
        mine = [r for r in records if r.slo_class == name]
        if mine:
            per_class[name] = sum(meets_slo(r) for r in mine) / len(mine)
    return {
        "attainment": len(met) / len(records),
        "goodput_tok_s": sum(r.num_output_tokens for r in met) / duration if duration else 0.0,
        "per_class": per_class,
    }


def mean_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    classes = sorted({c for s in summaries for c in s["per_class"]})
    return {
        "attainment": statistics.fmean(s["attainment"] for s in summaries),
        "goodput_tok_s": statistics.fmean(s["goodput_tok_s"] for s in summaries),
        "per_class": {
            c: statistics.fmean(s["per_class"][c] for s in summaries if c in s["per_class"])
            for c in classes
        },
    }


def sweep(
    workload: Workload,
    setup: Setup,
    rate: float,
    mix: Mix,
    selectors: Sequence[str],
) -> dict[str, dict[str, Any]]:
    """Each selector's mean summary over the setup's draws of the trace (the same draws for
    every selector)."""
    baseline = baseline_latency_ms(setup.machine)
    draws = [
        workload.requests(rate, setup.requests, baseline, mix, seed=d) for d in range(setup.draws)
    ]
    return {
        selector: mean_summary([slo_summary(simulate_selector(r, setup, selector)) for r in draws])
        for selector in selectors
    }


def rates(
    workload: Workload,
    setup: Setup,
    rates_rps: Sequence[float],
    selectors: Sequence[str] = SELECTORS,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """AdaServe's Fig. 4-5 on one machine: per rate, every selector's attainment and goodput."""
    out: dict[str, Any] = {
        "baseline_latency_ms": baseline_latency_ms(setup.machine),
        "hardware_budget": setup.machine.cost.hardware_budget(),
        "rates": {},
    }
    for rate in rates_rps:
        out["rates"][rate] = sweep(workload, setup, rate, Mix(), selectors)
        if progress is not None:
            row = out["rates"][rate]
            progress(
                f"{setup.machine.label} {rate:g} req/s: "
                + ", ".join(f"{s} {row[s]['attainment']:.0%}" for s in selectors)
            )
    out["verdict"] = verdict(out["rates"])
    return out


def urgent(
    workload: Workload,
    setup: Setup,
    rate: float,
    shares: Sequence[float],
    selectors: Sequence[str] = SELECTORS,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """AdaServe's Fig. 6: at `rate`, the urgent share swept."""
    out: dict[str, Any] = {"rate": rate, "shares": {}}
    for share in shares:
        out["shares"][share] = sweep(workload, setup, rate, urgent_share_mix(share), selectors)
        if progress is not None:
            row = out["shares"][share]
            progress(
                f"{setup.machine.label} urgent {share:.0%}: "
                + ", ".join(f"{s} {row[s]['attainment']:.0%}" for s in selectors)
            )
    return out


def verdict(by_rate: dict[float, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The issue's targets: at the highest rate where a baseline still attains 50%, AdaServe's
    attainment over the best baseline's (target 1.5x); and whether AdaServe has the best
    goodput at every rate."""
    ok_rates = [
        rate
        for rate, row in by_rate.items()
        if any(row[b]["attainment"] >= 0.5 for b in BASELINES if b in row)
    ]
    out: dict[str, Any] = {"rate": None, "attainment_ratio": None}
    if ok_rates and all("adaserve" in row for row in by_rate.values()):
        rate = max(ok_rates)
        row = by_rate[rate]
        best = max(row[b]["attainment"] for b in BASELINES if b in row)
        out["rate"] = rate
        out["attainment_ratio"] = row["adaserve"]["attainment"] / best if best else None
    out["best_goodput_everywhere"] = all(
        row["adaserve"]["goodput_tok_s"] >= max(v["goodput_tok_s"] for v in row.values()) - 1e-9
        for row in by_rate.values()
        if "adaserve" in row
    )
    return out
