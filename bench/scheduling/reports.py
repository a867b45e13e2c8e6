"""Run the simulated experiments for the CLI, and turn every experiment's result into a markdown
table and a plot."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.scheduling import experiments as ex
from bench.scheduling.workloads import Labelled
from shared.settings import LapsSettings
from tools.sim.acceptance import AcceptanceModel


def _runs(args: argparse.Namespace) -> list[ex.PolicyRun]:
    return [ex.BY_LABEL[label] for label in args.policies]


def _per_machine(
    args: argparse.Namespace,
    machines: Sequence[ex.Machine],
    laps: LapsSettings,
    experiment: Callable[[ex.Machine], dict[str, Any]],
) -> dict[str, Any]:
    """The parameters every simulated result records, and the experiment on each machine."""
    by_machine = {machine.label: experiment(machine) for machine in machines}
    return {"laps": laps.model_dump(), "draws": args.draws, "machines": by_machine}


def run_paper(
    args: argparse.Namespace,
    machines: Sequence[ex.Machine],
    acceptance: AcceptanceModel,
    items: Sequence[Labelled],
    laps: LapsSettings,
) -> dict[str, Any]:
    result = _per_machine(args, machines, laps, lambda machine: ex.paper(
        items, machine, acceptance,
        workloads=args.workloads, sizes=args.sizes, draws=args.draws, runs=_runs(args),
        laps=laps, draft=args.draft, progress=ex.log_progress,
    ))  # fmt: skip
    plot_paper(args.out / "paper.png", result)
    return result


def run_queues(
    args: argparse.Namespace,
    machines: Sequence[ex.Machine],
    acceptance: AcceptanceModel,
    items: Sequence[Labelled],
    laps: LapsSettings,
) -> dict[str, Any]:
    result = _per_machine(args, machines, laps, lambda machine: ex.queues(
        items, machine, acceptance,
        workloads=args.workloads, sizes=args.sizes, num_queues=args.queues, draws=args.draws,
        laps=laps, draft=args.draft, progress=ex.log_progress,
    ))  # fmt: skip
    plot_queues(args.out / "queues.png", result)
    return result


def run_load(
    args: argparse.Namespace,
    machines: Sequence[ex.Machine],
    acceptance: AcceptanceModel,
    items: Sequence[Labelled],
    laps: LapsSettings,
) -> dict[str, Any]:
    result = _per_machine(args, machines, laps, lambda machine: ex.load(
        items, machine, acceptance,
        workload=args.workload, num_requests=args.requests, batch_size=args.batch_size,
        loads=args.loads, draws=args.draws, runs=_runs(args), laps=laps, draft=args.draft,
        progress=ex.log_progress,
    ))  # fmt: skip
    return {"batch_size": args.batch_size, "workload": args.workload, **result}


SIMULATED: dict[str, Callable[..., dict[str, Any]]] = {
    "paper": run_paper,
    "queues": run_queues,
    "load": run_load,
}


# ---- tables ------------------------------------------------------------------------------------
def markdown(experiment: str, result: dict[str, Any]) -> str:
    return {
        "paper": _paper_md,
        "queues": _queues_md,
        "load": _load_md,
        "estimate": _estimate_md,
        "real": _real_md,
    }[experiment](result)


def _paper_md(result: dict[str, Any]) -> str:
    lines = []
    for machine, table in result["machines"].items():
        labels = list(next(iter(next(iter(table.values())).values())))
        lines += [
            f"Mean latency (s), B = 1, requests arriving together, {machine} "
            f"(mean of {result['draws']} draws):",
            "",
            "| workload | n | " + " | ".join(labels) + " | LAPS-SD vs LP-SJF | vs LAS |",
            "|---|---|" + "---|" * (len(labels) + 2),
        ]
        for workload, by_n in table.items():
            for n, row in by_n.items():
                cells = " | ".join(f"{row[k]:.2f}" for k in labels)
                vs = [
                    f"{-100 * ex.reduction(row, 'laps-sd', other):+.0f}%"
                    if {"laps-sd", other} <= set(row)
                    else "-"
                    for other in ("lp-sjf", "las")
                ]
                lines.append(f"| {workload} | {n} | {cells} | {vs[0]} | {vs[1]} |")
        lines.append("")
    return "\n".join(lines)


def _queues_md(result: dict[str, Any]) -> str:
    lines = []
    for machine, table in result["machines"].items():
        ks = list(next(iter(next(iter(table.values())).values())))
        lines += [
            f"LAPS-SD mean latency (s) by number of queues K, B = 1, {machine}:",
            "",
            "| workload | n | " + " | ".join(f"K={k}" for k in ks) + " | best K |",
            "|---|---|" + "---|" * (len(ks) + 1),
        ]
        for workload, by_n in table.items():
            for n, row in by_n.items():
                best = min(row, key=row.__getitem__)
                cells = " | ".join(f"{row[k]:.2f}" for k in ks)
                lines.append(f"| {workload} | {n} | {cells} | {best} |")
        lines.append("")
    return "\n".join(lines)


def _load_md(result: dict[str, Any]) -> str:
    lines = []
    for machine, data in result["machines"].items():
        first = next(iter(data["loads"].values()))
        labels = list(first["policies"])
        lines += [
            f"Mean / p99 latency (s), running set B = {result['batch_size']}, Poisson arrivals, "
            f"{result['workload']} workload, {machine} (capacity {data['capacity_rps']:.3f} "
            "req/s):",
            "",
            "| load | req/s | " + " | ".join(labels) + " |",
            "|---|---|" + "---|" * len(labels),
        ]
        for fraction, row in data["loads"].items():
            cells = " | ".join(
                f"{row['policies'][k]['mean_s']:.2f} / {row['policies'][k]['p99_s']:.2f}"
                for k in labels
            )
            lines.append(f"| {fraction} | {row['rate_rps']:.3f} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def _estimate_md(result: dict[str, Any]) -> str:
    lines = [
        "Eq. 6 against real execution time (the engine, B = 1), from the step each request "
        "became perceptible:",
        "",
        "| lengths | requests | mean abs. error | median | by kind |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["errors"].items():
        kinds = ", ".join(f"{k} {100 * v:.1f}%" for k, v in row["by_kind"].items())
        lines.append(
            f"| {name} | {row['requests']} | {100 * row['mean']:.1f}% | "
            f"{100 * row['median']:.1f}% | {kinds} |"
        )
    return "\n".join(lines) + "\n"


def _real_md(result: dict[str, Any]) -> str:
    lines = [
        f"Real replays through the services, {result['requests']} requests arriving together, "
        f"running set B = {result['batch_size']}, {result['workload']} workload:",
        "",
        "| policy | mean latency (s) | p99 (s) | simulated mean (s) | preemptions |",
        "|---|---|---|---|---|",
    ]
    for label, row in result["policies"].items():
        kinds = ", ".join(f"{k} {v}" for k, v in row["preemptions"].items() if v) or "none"
        lines.append(
            f"| {label} | {row['mean_s']:.2f} | {row['p99_s']:.2f} | "
            f"{row['simulated_mean_s']:.2f} | {kinds} |"
        )
    lines += ["", f"Ranking real: {result['ranking_real']}; simulated: {result['ranking_sim']}."]
    return "\n".join(lines) + "\n"


# ---- plots -------------------------------------------------------------------------------------
def plot_paper(path: Path, result: dict[str, Any]) -> None:
    machines = result["machines"]
    workloads = list(next(iter(machines.values())))

    def panels(axes: Any) -> None:
        for i, (machine, table) in enumerate(machines.items()):
            for j, workload in enumerate(workloads):
                ax = axes[i][j]
                sizes = [int(n) for n in table[workload]]
                for label in next(iter(table[workload].values())):
                    values = [table[workload][str(n)][label] for n in sizes]
                    style = "--" if "oracle" in label else "-"
                    ax.plot(sizes, values, style, marker="o", label=label)
                ax.set_title(f"{workload} ({machine})", fontsize=9)
                ax.set_xlabel("requests")
                ax.set_ylabel("mean latency (s)")
        axes[0][0].legend(fontsize=7)

    ex.save_plot(path, panels, ncols=len(workloads), nrows=len(machines))


def plot_queues(path: Path, result: dict[str, Any]) -> None:
    machines = result["machines"]
    workloads = list(next(iter(machines.values())))

    def panels(axes: Any) -> None:
        for i, (machine, table) in enumerate(machines.items()):
            for j, workload in enumerate(workloads):
                ax = axes[i][j]
                for n, row in table[workload].items():
                    ks = [int(k) for k in row]
                    ax.plot(ks, [row[str(k)] for k in ks], marker="o", label=f"{n} requests")
                ax.set_title(f"{workload} ({machine})", fontsize=9)
                ax.set_xlabel("queues K")
                ax.set_ylabel("mean latency (s)")
        axes[0][0].legend(fontsize=7)

    ex.save_plot(path, panels, ncols=len(workloads), nrows=len(machines))
