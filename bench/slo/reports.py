"""Markdown tables and plots of the SLO experiments' results (`bench.slo.experiments`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _cell(summary: dict[str, Any]) -> str:
    return f"{summary['attainment']:.0%} / {summary['goodput_tok_s']:.1f}"


def rates_markdown(machine: str, result: dict[str, Any]) -> list[str]:
    rows_by_rate = result["rates"]
    selectors = list(next(iter(rows_by_rate.values())))
    lines = [
        f"### {machine}: SLO attainment / goodput (tok/s) per rate",
        "",
        f"Baseline latency {result['baseline_latency_ms']:.1f} ms, hardware budget "
        f"{result['hardware_budget']} tokens, step overhead {result['step_overhead_ms']:.1f} ms.",
        "",
    ]
    rows = [
        [f"{rate:g}", *(_cell(row[s]) for s in selectors)] for rate, row in rows_by_rate.items()
    ]
    lines += _table(["req/s", *selectors], rows)
    lines += ["", "Per class (urgent / standard / relaxed attainment):", ""]
    rows = [
        [
            f"{rate:g}",
            *(
                " / ".join(
                    f"{row[s]['per_class'].get(c, 0.0):.0%}"
                    for c in ("urgent", "standard", "relaxed")
                )
                for s in selectors
            ),
        ]
        for rate, row in rows_by_rate.items()
    ]
    lines += _table(["req/s", *selectors], rows)
    v = result["verdict"]
    ratio = "n/a" if v["attainment_ratio"] is None else f"{v['attainment_ratio']:.2f}x"
    lines += [
        "",
        f"AdaServe over the best baseline at {v['rate']} req/s (the highest rate where a baseline "
        f"attains 50%): {ratio}; best goodput at every rate: {v['best_goodput_everywhere']}.",
    ]
    return lines


def urgent_markdown(machine: str, result: dict[str, Any]) -> list[str]:
    by_share = result["shares"]
    selectors = list(next(iter(by_share.values())))
    lines = [
        f"### {machine}: SLO attainment / goodput at {result['rate']:g} req/s by urgent share",
        "",
    ]
    rows = [
        [f"{share:.0%}", *(_cell(row[s]) for s in selectors)] for share, row in by_share.items()
    ]
    return lines + _table(["urgent share", *selectors], rows)


def real_markdown(result: dict[str, Any]) -> list[str]:
    """`bench.slo.real.real`'s result: per rate, each selector really and simulated."""
    lines = [
        "### Real replays through the services: attainment / goodput (tok/s), real and simulated",
        "",
        f"{result['requests']} requests per rate, running set {result['batch_size']}, objectives "
        + ", ".join(f"{c} {ms:.0f} ms" for c, ms in result["objectives_ms"].items())
        + f"; simulated with a per-step overhead of {result['step_overhead_ms']:.1f} + "
        f"{result['request_overhead_ms']:.1f} x sqrt(decoding requests) ms fitted on the runs.",
        "",
    ]
    rows = []
    for rate, row in result["rates"].items():
        for name, r in row["selectors"].items():
            rows.append(
                [
                    f"{float(rate):g}",
                    name,
                    f"{r['attainment']:.0%} / {r['goodput_tok_s']:.1f}",
                    f"{r['sim_attainment']:.0%} / {r['sim_goodput_tok_s']:.1f}",
                    f"{r['mean_tpot_ms']:.0f} / {r['sim_mean_tpot_ms']:.0f}",
                ]
            )
    lines += _table(["req/s", "selector", "real", "simulated", "mean TPOT ms (real / sim)"], rows)
    lines += ["", "Rankings (by attainment, ties by goodput):", ""]
    rows = [
        [
            f"{float(rate):g}",
            ", ".join(row["ranking_real"]),
            ", ".join(row["ranking_sim"]),
            f"{row['kendall_tau']:.2f}",
        ]
        for rate, row in result["rates"].items()
    ]
    return lines + _table(["req/s", "real", "simulated", "Kendall tau"], rows)


def write_markdown(path: Path, lines: Sequence[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def plot(path: Path, experiment: str, machine: str, result: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rates"] if experiment == "rates" else result["shares"]
    xs = list(rows)
    selectors = list(next(iter(rows.values())))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s in selectors:
        axes[0].plot(xs, [rows[x][s]["attainment"] for x in xs], marker="o", label=s)
        axes[1].plot(xs, [rows[x][s]["goodput_tok_s"] for x in xs], marker="o", label=s)
    label = "request rate (req/s)" if experiment == "rates" else "urgent share"
    for ax, what in zip(axes, ("SLO attainment", "goodput (tok/s)"), strict=True):
        ax.set_xlabel(label)
        ax.set_ylabel(what)
        if experiment == "rates":
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(machine)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
