"""Side-by-side comparison of load-test runs (directories `tools.load.report.write_report` wrote).

`compare` returns a Markdown table of the key metrics, one column per run (labelled by the run's
`meta["label"]`, or else its directory name), and can write it with a PNG of bar charts and
overlaid TPOT CDFs.

    python -m tools.load.compare RUN_DIR RUN_DIR... [--out DIR]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tools.load.records import tpot_ms
from tools.load.report import (
    RECORDS_JSONL,
    fmt,
    load_records,
    load_report,
    pct,
)

COMPARE_MD = "compare.md"
COMPARE_PNG = "compare.png"

Report = dict[str, Any]


def _stat(key: str, quantile: str, scale: float = 1.0) -> Callable[[Report], str]:
    return lambda r: fmt(r[key][quantile], 2, scale)


def _count(key: str) -> Callable[[Report], str]:
    return lambda r: str(r[key])


# (row label, how to show it from a report.json)
ROWS: tuple[tuple[str, Callable[[Report], str]], ...] = (
    ("requests", _count("requests")),
    ("completed", _count("completed")),
    ("failed", _count("failed")),
    ("mean TTFT (ms)", _stat("ttft_s", "mean", 1000.0)),
    ("p50 TTFT (ms)", _stat("ttft_s", "p50", 1000.0)),
    ("p99 TTFT (ms)", _stat("ttft_s", "p99", 1000.0)),
    ("mean TPOT (ms)", _stat("tpot_ms", "mean")),
    ("p99 TPOT (ms)", _stat("tpot_ms", "p99")),
    ("mean E2E (s)", _stat("e2e_s", "mean")),
    ("SLO attainment", lambda r: pct(r["slo_attainment"])),
    ("goodput (tok/s)", lambda r: fmt(r["goodput_tok_s"], 1)),
    ("throughput (tok/s)", lambda r: fmt(r["throughput_tok_s"], 1)),
    ("mean accepted length", lambda r: fmt(r["mean_accepted_length"], 3)),
)


def labels_for(dirs: Sequence[Path], reports: Sequence[Report]) -> list[str]:
    """Each run's `meta["label"]` or directory name; repeated labels get " (2)", " (3)"..."""
    labels: list[str] = []
    for d, report in zip(dirs, reports, strict=True):
        base = str((report.get("meta") or {}).get("label") or Path(d).resolve().name)
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base} ({n})"
        labels.append(label)
    return labels


def table(labels: Sequence[str], reports: Sequence[Report]) -> str:
    """The Markdown table: one row per metric, one column per run."""
    lines = [
        "| metric | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for name, show in ROWS:
        lines.append(f"| {name} | " + " | ".join(show(r) for r in reports) + " |")
    return "\n".join(lines) + "\n"


def compare(dirs: Sequence[Path], out: Path | None = None) -> str:
    """The comparison table of the runs in `dirs`; with `out`, also out/compare.md and .png.

    Raises ValueError naming the directory when one holds no (valid) report.json.
    """
    if not dirs:
        raise ValueError("compare: no run directories given")
    dirs = [Path(d) for d in dirs]
    reports = [load_report(d) for d in dirs]
    labels = labels_for(dirs, reports)
    text = table(labels, reports)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / COMPARE_MD).write_text(f"# Load test comparison\n\n{text}")
        tpots = {label: _tpots(d) for label, d in zip(labels, dirs, strict=True)}
        plot_compare(out / COMPARE_PNG, labels, reports, tpots)
    return text


def _tpots(run_dir: Path) -> list[float] | None:
    """The run's per-request TPOTs (ms) from its records.jsonl; None when it has none."""
    if not (run_dir / RECORDS_JSONL).is_file():
        return None
    return [v for r in load_records(run_dir) if (v := tpot_ms(r)) is not None]


# (panel title, value from a report.json) for the bar charts
BARS: tuple[tuple[str, Callable[[Report], float | None]], ...] = (
    ("mean TTFT (ms)", lambda r: _scaled(r["ttft_s"]["mean"], 1000.0)),
    ("mean TPOT (ms)", lambda r: r["tpot_ms"]["mean"]),
    ("p99 TPOT (ms)", lambda r: r["tpot_ms"]["p99"]),
    ("SLO attainment (%)", lambda r: _scaled(r["slo_attainment"], 100.0)),
    ("goodput (tok/s)", lambda r: r["goodput_tok_s"]),
)


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def plot_compare(
    path: Path,
    labels: Sequence[str],
    reports: Sequence[Report],
    tpots: dict[str, list[float] | None],
) -> Path:
    """Bar charts of the key metrics per run, and the runs' TPOT CDFs overlaid."""
    from tools.load import plots  # matplotlib only when plotting (plots selects Agg first)

    plt, cdf, no_data = plots.plt, plots.cdf, plots.no_data
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, value) in zip(axes.flat, BARS, strict=False):
        values = [value(r) for r in reports]
        bars = ax.bar(range(len(labels)), [v or 0.0 for v in values], color="tab:blue")
        ax.bar_label(bars, ["-" if v is None else f"{v:.3g}" for v in values])
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    ax = axes.flat[len(BARS)]
    drawn = {label: v for label, v in tpots.items() if v}
    if not drawn:
        no_data(ax, "TPOT CDF")
    for label, values in drawn.items():
        cdf(ax, values, label=label)
    if drawn:
        ax.set_title("TPOT CDF")
        ax.set_xlabel("TPOT (ms)")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Compare load-test runs side by side")
    parser.add_argument("dirs", nargs="+", type=Path, help="run directories (with report.json)")
    parser.add_argument("--out", type=Path, help="write compare.md and compare.png here")
    args = parser.parse_args(argv)
    try:
        print(compare(args.dirs, args.out), end="")
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
