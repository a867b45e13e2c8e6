"""The tree selectors as real replays through the services, beside the simulator's account of them.

    real(selectors, rates, *, num_requests, batch_size, draft, seed, timeout_s, out_dir,
         acceptance, progress=None, workload=None, logs=LOGS) -> dict

For each rate and each selector the services start fresh (`python -m services all --drafts
<draft> --threads 2 --log-level DEBUG`, in a cell of their own on the system Redis, as
`bench.scheduling.real` starts them) with `scheduler.tree_selection = <selector>` and a running
set of `batch_size` (`AUGURY_SCHEDULER__TREE_SELECTION`, `AUGURY_SCHEDULER__MAX_RUNNING_REQUESTS`).
Every selector at a rate replays the same trace: `Workload.requests(rate, num_requests,
baseline_ms, seed=seed)` (AdaServe's 60/20/20 class mix, bursty arrivals), each request with its
class and explicit `tpot_slo_ms`. The baseline latency the classes are multiples of is the one
of the cost profile the services themselves publish: read from the cell of the first run once it
is ready (before its replay), so the objectives are exactly the services' (every later run loads
the same stored profile; a run whose published baseline differs is flagged).

Each run's records go to `out_dir/real/<rate>/<selector>/` (`tools.load.report.write_report`);
its row holds `slo_summary` (attainment, goodput, per class), mean TPOT and the failed requests
(a failure counts as a missed objective, it does not stop the experiment; services that crash or
never get ready leave an `error` and the traceback from their log in the row instead).

Then the simulator serves the same traces with each selector (`bench.slo.experiments
.simulate_selector`), on the profile the services published and the per-step overhead fitted
(`tools.sim.calibrate.fit_overheads`: a + b * sqrt(decoding requests)) on the scheduler's DEBUG
logs of all runs. Per rate, the selectors are ranked by attainment (ties by goodput), really and
simulated, and the two rankings compared by Kendall's tau and Spearman's rho.

The committed result (docs/results/slo/real.json, with the call in its "call") was made on a
2-core CPU (no GPU) by a driver script calling

    real(["adaserve", "thesis-slo", "goodput", "incremental"], [0.05, 0.1, 0.2], num_requests=16,
         batch_size=8, draft="draft-s", seed=0, timeout_s=900.0,
         out_dir=Path("docs/results/slo"),
         acceptance=AcceptanceModel.load("profiles/acceptance-SmolLM2-135M-Instruct.json.gz"))

    (PYTHONPATH=. .venv/bin/python /tmp/slo_real_driver.py: 12 runs of 2 to 6 minutes, bound by
    their ~5000 output tokens; the services' profile and the fitted overheads are left in
    out_dir/real/profile.json and the JSON, so the simulation can be redone without services)

Logs (DEBUG, large) go to `.cache/bench-slo/`.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scipy import stats

from bench.scheduling.real import REDIS_URL, Served, replay_and_read, running
from bench.slo.workloads import CLASSES, Mix, SloRequest, Workload, trace_requests
from shared.model.model_set import REPO_ROOT
from shared.scheduling.cost_model import CostModel
from tools.load.records import RequestRecord, tpot_ms
from tools.sim.acceptance import AcceptanceModel

LOGS = REPO_ROOT / ".cache" / "bench-slo"
TRACEBACK_LINES = 40

Progress = Callable[[str], None]


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def selector_env(selector: str, batch_size: int) -> dict[str, str]:
    """The settings (as environment variables) of a selector's run."""
    return {
        "AUGURY_SCHEDULER__TREE_SELECTION": selector,
        "AUGURY_SCHEDULER__MAX_RUNNING_REQUESTS": str(batch_size),
    }


def shown(path: Path) -> str:
    """`path` as the results show it: from the repository's root where it is inside."""
    return str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)


def run_name(rate: float, selector: str) -> str:
    return f"{rate:g}-{selector}"


async def published_cost(cell: str) -> CostModel:
    """The cost model the services of `cell` published (their keys stay)."""
    from shared.bus import Bus
    from shared.bus.profiles import assemble, read_profiles
    from shared.settings import RedisSettings

    bus = Bus(REDIS_URL, RedisSettings(url=REDIS_URL), "bench-slo")
    try:
        profile = assemble(await read_profiles(bus, cell))
    finally:
        await bus.close()
    if profile is None:
        raise RuntimeError(f"{cell}: the services published no cost profile")
    return CostModel(profile)


def mean_tpot_ms(records: Sequence[RequestRecord]) -> float | None:
    values = [v for v in (tpot_ms(r) for r in records) if v is not None]
    return statistics.fmean(values) if values else None


def describe(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """`slo_summary` plus mean TPOT (overall and per class) and the failed requests."""
    from bench.slo.experiments import slo_summary

    out = slo_summary(records)
    out["mean_tpot_ms"] = mean_tpot_ms(records)
    out["per_class_mean_tpot_ms"] = {
        c: mean_tpot_ms([r for r in records if r.slo_class == c])
        for c in CLASSES
        if any(r.slo_class == c for r in records)
    }
    out["failed"] = sum(not r.is_completed for r in records)
    return out


def traceback_of(log: Path, lines: int = TRACEBACK_LINES) -> str | None:
    """The last traceback in a services log (`lines` lines from its start), or None."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]
    return "\n".join(text[starts[-1] : starts[-1] + lines]) if starts else None


def ranking(rows: Mapping[str, Mapping[str, Any]], prefix: str = "") -> list[str]:
    """Names by attainment, ties by goodput (both descending), then by name."""
    return sorted(
        rows,
        key=lambda s: (-rows[s][f"{prefix}attainment"], -rows[s][f"{prefix}goodput_tok_s"], s),
    )


def _positions(a: Sequence[str], b: Sequence[str]) -> tuple[list[int], list[int]] | None:
    """Each name's place in `a` and in `b` (None: fewer than two names to compare)."""
    if sorted(a) != sorted(b):
        raise ValueError(f"not the same names: {a} and {b}")
    if len(a) < 2:
        return None
    place = {name: i for i, name in enumerate(b)}
    return list(range(len(a))), [place[name] for name in a]


def kendall_tau(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Kendall's tau between two orderings of the same names (1: same order, -1: reversed)."""
    places = _positions(a, b)
    return None if places is None else float(stats.kendalltau(*places).statistic)


def spearman_rho(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Spearman's rho between two orderings of the same names."""
    places = _positions(a, b)
    return None if places is None else float(stats.spearmanr(*places).statistic)


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall's tau-b between paired values, ties counted as ties (None: either is constant)."""
    if len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return float(stats.kendalltau(x, y, variant="b").statistic)


def agreement(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The real and simulated rankings of the rows that have both, and their agreement: of the
    rankings (Kendall's tau, Spearman's rho), and of the attainments alone with their ties left
    tied (tau-b: a tie on attainment is no order, whatever the goodputs say)."""
    both = {s: row for s, row in rows.items() if "attainment" in row and "sim_attainment" in row}
    real_order, sim_order = ranking(both), ranking(both, "sim_")
    return {
        "ranking_real": real_order,
        "ranking_sim": sim_order,
        "kendall_tau": kendall_tau(real_order, sim_order),
        "spearman_rho": spearman_rho(real_order, sim_order),
        "attainment_tau_b": kendall_tau_b(
            [both[s]["attainment"] for s in both], [both[s]["sim_attainment"] for s in both]
        ),
    }


def default_workload(seed: int) -> Workload:
    from transformers import AutoTokenizer

    from bench.scheduling.workloads import load_heldout
    from shared.model.model_set import target_dir

    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    return Workload(tokenizer, load_heldout(tokenizer), seed=seed)


def real(
    selectors: Sequence[str],
    rates: Sequence[float],
    *,
    num_requests: int,
    batch_size: int,
    draft: str,
    seed: int,
    timeout_s: float,
    out_dir: Path,
    acceptance: AcceptanceModel,
    progress: Progress | None = None,
    workload: Workload | None = None,
    logs: Path = LOGS,
) -> dict[str, Any]:
    """Every selector at every rate, really (fresh services each) and simulated; see the module.

    `timeout_s`: how long a request may take (the replay's timeout and the gateway's output
    idle timeout). `progress`: a line per run (default: stderr). `workload`: the requests'
    source (default: the held-out prompts chat-templated by the target's tokenizer).
    """
    from bench.scheduling.experiments import Machine
    from bench.slo.experiments import Setup, simulate_selector
    from tools.load.report import write_report
    from tools.sim.calibrate import fit_overheads, mean_overhead, parse_log

    say = progress or to_stderr
    workload = workload or default_workload(seed)
    mix = Mix()
    started = time.perf_counter()
    baseline_ms: float | None = None
    cost: CostModel | None = None
    traces: dict[float, list[SloRequest]] = {}
    served: dict[tuple[float, str], Served] = {}
    rows: dict[float, dict[str, dict[str, Any]]] = {rate: {} for rate in rates}
    for rate in rates:
        for selector in selectors:
            name = run_name(rate, selector)
            row = rows[rate][selector] = {}
            t0 = time.perf_counter()
            try:
                with running(
                    name,
                    selector_env(selector, batch_size),
                    draft=draft,
                    timeout_s=timeout_s,
                    logs=logs,
                ) as services:
                    row["log"] = shown(services.log)
                    published = asyncio.run(published_cost(services.cell))
                    if baseline_ms is None:  # the first run: the objectives of all of them
                        cost, baseline_ms = published, published.baseline_latency_ms()
                    elif abs(published.baseline_latency_ms() - baseline_ms) > 1e-6:
                        row["baseline_latency_ms"] = published.baseline_latency_ms()
                    if rate not in traces:
                        traces[rate] = workload.requests(
                            rate, num_requests, baseline_ms, mix, seed=seed
                        )
                    run = replay_and_read(
                        name, services, trace_requests(traces[rate]), timeout_s, strict=False
                    )
            except Exception as error:  # noqa: BLE001 - a crashed run is a result, not the end
                log = logs / f"{name}.log"
                row.update(error=f"{type(error).__name__}: {error}", log=shown(log))
                row["traceback"] = traceback_of(log)
                say(f"{name}: FAILED after {time.perf_counter() - t0:.0f} s: {row['error']}")
                continue
            served[rate, selector] = run
            summary = describe(run.records)
            row.update(summary, wall_s=round(time.perf_counter() - t0, 1))
            row["preemptions"] = run.preemptions
            write_report(
                out_dir / "real" / f"{rate}" / selector,
                run.records,
                meta={
                    "selector": selector,
                    "rate": rate,
                    "requests": num_requests,
                    "batch_size": batch_size,
                    "draft": draft,
                    "seed": seed,
                    "baseline_latency_ms": baseline_ms,
                    "objectives_ms": mix.objectives_ms(baseline_ms or 0.0),
                },
                plots=False,
            )
            mean = summary["mean_tpot_ms"]
            say(
                f"{name}: attainment {summary['attainment']:.0%}, goodput "
                f"{summary['goodput_tok_s']:.1f} tok/s, mean TPOT "
                f"{'-' if mean is None else f'{mean:.0f} ms'}, {summary['failed']} failed, "
                f"{row['wall_s']:.0f} s"
            )
    out: dict[str, Any] = {
        "selectors": list(selectors),
        "requests": num_requests,
        "batch_size": batch_size,
        "draft": draft,
        "seed": seed,
        "timeout_s": timeout_s,
        "baseline_latency_ms": baseline_ms,
        "objectives_ms": mix.objectives_ms(baseline_ms) if baseline_ms is not None else None,
        "failed_requests": sum(r.get("failed", 0) for row in rows.values() for r in row.values()),
        "failed_runs": [
            run_name(rate, s) for rate, row in rows.items() for s, r in row.items() if "error" in r
        ],
    }
    if cost is None or not served:
        out["rates"] = rows
        return out
    # the simulator on the services' own profile, with their per-step overhead fitted on the
    # scheduler's DEBUG logs of every run (a + b * sqrt(decoding requests))
    steps = [s for run in served.values() for s in parse_log(run.log.read_text().splitlines())]
    try:
        step_ms, request_ms = fit_overheads(steps, cost)
    except ValueError:  # every step had the same number of decoding requests: one number
        step_ms, request_ms = mean_overhead(steps, cost), 0.0
    machine = Machine("services' profile", cost, step_ms, request_ms)
    (out_dir / "real").mkdir(parents=True, exist_ok=True)  # to simulate again without services
    cost.profile.save(out_dir / "real" / "profile.json")
    setup = Setup(machine, acceptance, batch_size, draft, requests=num_requests, draws=1)
    out.update(
        device=cost.profile.target.key.device,
        step_overhead_ms=step_ms,
        request_overhead_ms=request_ms,
        calibration_steps=len(steps),
        profile="real/profile.json",  # under out_dir
        attainment_resolution=1 / num_requests,  # one request more or less
    )
    for rate, row in rows.items():
        for selector, r in row.items():
            if rate not in traces:
                continue
            try:
                simulated = describe(simulate_selector(traces[rate], setup, selector))
            except Exception as error:  # noqa: BLE001 - reported in the row
                r["sim_error"] = f"{type(error).__name__}: {error}"
                continue
            r.update({f"sim_{key}": value for key, value in simulated.items()})
        say(
            f"{rate:g} req/s simulated: "
            + ", ".join(
                f"{s} {r['sim_attainment']:.0%}" for s, r in row.items() if "sim_attainment" in r
            )
        )
    out["rates"] = {rate: {"selectors": row, **agreement(row)} for rate, row in rows.items()}
    taus = [v["kendall_tau"] for v in out["rates"].values() if v["kendall_tau"] is not None]
    out["mean_kendall_tau"] = statistics.fmean(taus) if taus else None
    out["wall_s"] = round(time.perf_counter() - started, 1)
    return out
