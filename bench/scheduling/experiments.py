"""The scheduling experiments on the simulator: LAPS-SD against FCFS, LAS and LP-SJF.

Every run is the real scheduler core with the named policy (`shared.scheduling`), on a virtual
clock whose step times come from a cost profile and whose acceptance replays recorded sessions
(`tools.sim`). Three experiments:

- `paper`: the LAPS-SD paper's Fig. 5. One request at a time (running set B = 1), 10 to 50
  requests arriving together, per workload: mean latency of each policy, averaged over several
  random draws of the requests.
- `queues`: its Fig. 6. LAPS-SD's mean latency as the number of queues K goes from 2 to 10.
- `load`: beyond the paper. A running set of B > 1 under Poisson arrivals at a rate near the
  capacity (measured first: FCFS's completion rate with every request queued at once): mean and
  p99 latency of each policy.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.scheduling.workloads import Labelled, burst, draw, poisson, pool, sim_requests
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import CostModel
from shared.settings import LapsSettings
from tools.load.records import RequestRecord
from tools.sim.acceptance import AcceptanceModel
from tools.sim.simulator import SimConfig, Simulator


@dataclass(frozen=True)
class PolicyRun:
    label: str
    policy: str
    predictor: str | None = None


POLICY_RUNS = (
    PolicyRun("fcfs", "fcfs"),
    PolicyRun("las", "las"),
    PolicyRun("lp-sjf", "lp-sjf", "learned"),
    PolicyRun("laps-sd", "laps-sd", "learned"),
    PolicyRun("lp-sjf/oracle", "lp-sjf", "oracle"),
    PolicyRun("laps-sd/oracle", "laps-sd", "oracle"),
)
BY_LABEL = {run.label: run for run in POLICY_RUNS}


@dataclass(frozen=True)
class Machine:
    """A cost profile and what the simulator adds to it."""

    label: str
    cost: CostModel
    step_overhead_ms: float = 0.0
    request_overhead_ms: float = 0.0

    @property
    def shared_device(self) -> bool:
        return self.cost.profile.target.key.device.startswith("cpu")


def simulate(
    items: Sequence[Labelled],
    arrivals: Sequence[float],
    machine: Machine,
    acceptance: AcceptanceModel,
    run: PolicyRun,
    *,
    batch_size: int,
    laps: LapsSettings,
    draft: str,
) -> list[RequestRecord]:
    config = SimConfig(
        SchedulerConfig(
            max_running_requests=batch_size,
            policy=run.policy,
            length_predictor=run.predictor,
            laps=laps,
        ),
        drafts=(draft,),
        shared_device=machine.shared_device,
        step_overhead_ms=machine.step_overhead_ms,
        request_overhead_ms=machine.request_overhead_ms,
    )
    records = Simulator(config, machine.cost, acceptance).run(sim_requests(items, arrivals))
    failed = [r for r in records if not r.is_completed]
    if failed:
        raise RuntimeError(f"{len(failed)} simulated requests failed: {failed[0].error}")
    return records


def latencies_s(records: Sequence[RequestRecord]) -> list[float]:
    return [r.finish_s - r.arrival_s for r in records if r.finish_s is not None]


def mean_latency_s(records: Sequence[RequestRecord]) -> float:
    return statistics.fmean(latencies_s(records))


def p99_latency_s(records: Sequence[RequestRecord]) -> float:
    return float(np.percentile(latencies_s(records), 99))


Progress = Callable[[str], None]


def log_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def burst_mean_s(
    candidates: Sequence[Labelled],
    n: int,
    draws: int,
    machine: Machine,
    acceptance: AcceptanceModel,
    run: PolicyRun,
    *,
    laps: LapsSettings,
    draft: str,
) -> float:
    """Mean latency (s) of `n` requests arriving together, one running at a time, averaged
    over `draws` draws of them (the same draws for every policy and parameter)."""
    means = []
    for d in range(draws):
        chosen = draw(candidates, n, seed=1000 * n + d)
        records = simulate(
            chosen, burst(n), machine, acceptance, run, batch_size=1, laps=laps, draft=draft
        )
        means.append(mean_latency_s(records))
    return statistics.fmean(means)


def paper(
    items: Sequence[Labelled],
    machine: Machine,
    acceptance: AcceptanceModel,
    *,
    workloads: Sequence[str],
    sizes: Sequence[int],
    draws: int,
    runs: Sequence[PolicyRun],
    laps: LapsSettings,
    draft: str,
    progress: Progress,
) -> dict[str, Any]:
    """Mean latency (s) per workload, request count and policy, averaged over `draws`."""
    table: dict[str, Any] = {}
    for workload in workloads:
        candidates = pool(items, workload)
        table[workload] = {}
        for n in sizes:
            row = {
                run.label: burst_mean_s(
                    candidates, n, draws, machine, acceptance, run, laps=laps, draft=draft
                )
                for run in runs
            }
            table[workload][str(n)] = row
            progress(f"{machine.label} {workload} n={n}: " + _row(row))
    return table


def queues(
    items: Sequence[Labelled],
    machine: Machine,
    acceptance: AcceptanceModel,
    *,
    workloads: Sequence[str],
    sizes: Sequence[int],
    num_queues: Sequence[int],
    draws: int,
    laps: LapsSettings,
    draft: str,
    progress: Progress,
) -> dict[str, Any]:
    """LAPS-SD's mean latency (s) per workload, request count and K."""
    run = BY_LABEL["laps-sd"]
    table: dict[str, Any] = {}
    for workload in workloads:
        candidates = pool(items, workload)
        table[workload] = {}
        for n in sizes:
            row = {
                str(k): burst_mean_s(
                    candidates,
                    n,
                    draws,
                    machine,
                    acceptance,
                    run,
                    laps=laps.model_copy(update={"num_queues": k}),
                    draft=draft,
                )  # fmt: skip
                for k in num_queues
            }
            table[workload][str(n)] = row
            progress(f"{machine.label} {workload} n={n}: K -> " + _row(row))
    return table


def capacity_rps(
    items: Sequence[Labelled],
    machine: Machine,
    acceptance: AcceptanceModel,
    *,
    batch_size: int,
    laps: LapsSettings,
    draft: str,
) -> float:
    """Requests per second the machine completes with every request queued at once (FCFS)."""
    records = simulate(
        items, burst(len(items)), machine, acceptance, BY_LABEL["fcfs"],
        batch_size=batch_size, laps=laps, draft=draft,
    )  # fmt: skip
    makespan = max(r.finish_s for r in records if r.finish_s is not None)
    return len(records) / makespan


def load(
    items: Sequence[Labelled],
    machine: Machine,
    acceptance: AcceptanceModel,
    *,
    workload: str,
    num_requests: int,
    batch_size: int,
    loads: Sequence[float],
    draws: int,
    runs: Sequence[PolicyRun],
    laps: LapsSettings,
    draft: str,
    progress: Progress,
) -> dict[str, Any]:
    """Mean and p99 latency (s) per load (a fraction of the capacity) and policy."""
    candidates = pool(items, workload)
    chosen = draw(candidates, min(num_requests, len(candidates)), seed=7)
    capacity = capacity_rps(
        chosen, machine, acceptance, batch_size=batch_size, laps=laps, draft=draft
    )
    out: dict[str, Any] = {"capacity_rps": capacity, "loads": {}}
    for fraction in loads:
        rate = fraction * capacity
        means: dict[str, list[float]] = {run.label: [] for run in runs}
        p99s: dict[str, list[float]] = {run.label: [] for run in runs}
        for d in range(draws):
            order = draw(chosen, len(chosen), seed=d)
            arrivals = poisson(len(order), rate, seed=d)
            for run in runs:
                records = simulate(
                    order, arrivals, machine, acceptance, run,
                    batch_size=batch_size, laps=laps, draft=draft,
                )  # fmt: skip
                means[run.label].append(mean_latency_s(records))
                p99s[run.label].append(p99_latency_s(records))
        row = {
            label: {
                "mean_s": statistics.fmean(means[label]),
                "p99_s": statistics.fmean(p99s[label]),
            }
            for label in means
        }
        out["loads"][str(fraction)] = {"rate_rps": rate, "policies": row}
        progress(
            f"{machine.label} load {fraction:.2f} ({rate:.3f} req/s): "
            + _row({k: v["mean_s"] for k, v in row.items()})
        )
    return out


def _row(values: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.2f}" for k, v in values.items())


def reduction(table: dict[str, float], better: str, worse: str) -> float:
    """How much lower `better`'s mean latency is than `worse`'s (0.3: 30% lower)."""
    return 1.0 - table[better] / table[worse]


def save_plot(path: Path, draw_panels: Callable[[Any], None], ncols: int, nrows: int = 1) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False, layout="constrained"
    )
    draw_panels(axes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
