"""The load-test report's PNG plots, drawn with matplotlib's Agg backend (no display needed).

`latency_cdfs.png`: CDFs of TTFT, TPOT and E2E side by side. `tpot_slo.png`: each request's TPOT
per SLO class, with the class's objective drawn as a line. `throughput.png`: output tokens/s of
all completed requests and of those that met their SLO (goodput), binned over the run from the
chunks' arrival times, with a tick under the axis at every request's arrival (black: completed,
red: failed), so an idle gap without arrivals does not read as a stall. Every plot copes with
no data (it then says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tools.load.records import NO_GROUP, RequestRecord, e2e_s, meets_slo, tpot_ms, ttft_s

matplotlib.use("Agg")  # before pyplot is imported: no display

import matplotlib.pyplot as plt  # noqa: E402

LATENCY_CDFS = "latency_cdfs.png"
TPOT_SLO = "tpot_slo.png"
THROUGHPUT = "throughput.png"
DPI = 110


def no_data(ax: Axes, title: str) -> None:
    """An empty panel that says there was nothing to plot."""
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def cdf(ax: Axes, values: Sequence[float], *, label: str | None = None) -> None:
    """The empirical CDF of `values` as a step line."""
    xs = np.sort(np.asarray(values, dtype=float))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)
    ax.set_ylim(0.0, 1.02)
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_latency_cdfs(path: Path, records: Sequence[RequestRecord]) -> Path:
    """TTFT (ms), TPOT (ms) and E2E (s) CDFs of the completed requests, side by side."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("TTFT", "TTFT (ms)", [1000.0 * v for r in records if (v := ttft_s(r)) is not None]),
        ("TPOT", "TPOT (ms)", [v for r in records if (v := tpot_ms(r)) is not None]),
        ("E2E latency", "E2E (s)", [v for r in records if (v := e2e_s(r)) is not None]),
    )
    for ax, (title, xlabel, values) in zip(axes, panels, strict=True):
        if not values:
            no_data(ax, title)
            continue
        cdf(ax, values)
        ax.set_title(f"{title} (n={len(values)})")
        ax.set_xlabel(xlabel)
    return _save(fig, path)


def _by_class(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.slo_class or NO_GROUP, []).append(r)
    return dict(sorted(groups.items()))


def _failed(records: Sequence[RequestRecord]) -> int:
    return sum(not r.is_completed for r in records)


def _class_strip(
    ax: Axes, x: int, records: Sequence[RequestRecord], rng: np.random.Generator
) -> None:
    """One class's TPOTs as a jittered strip at `x` (met and missed apart) and its SLO lines."""
    for met, color, label in ((True, "tab:green", "met"), (False, "tab:red", "missed")):
        ys = [v for r in records if (v := tpot_ms(r)) is not None and meets_slo(r) == met]
        xs = x + rng.uniform(-0.25, 0.25, len(ys))
        ax.scatter(xs, ys, s=10, alpha=0.6, color=color, label=label if x == 0 else None)
    for slo in sorted({r.tpot_slo_ms for r in records if r.tpot_slo_ms is not None}):
        ax.hlines(slo, x - 0.4, x + 0.4, colors="black", linestyles="--", linewidth=1.5)


def plot_tpot_slo(path: Path, records: Sequence[RequestRecord]) -> Path:
    """Per SLO class, each TPOT (green: met, red: missed) and the SLO as a dashed line."""
    groups = _by_class(records)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.5))
    if not any(tpot_ms(r) is not None for r in records):
        no_data(ax, "TPOT against SLO")
        return _save(fig, path)
    rng = np.random.default_rng(0)  # fixed jitter: the same records give the same picture
    for x, members in enumerate(groups.values()):
        _class_strip(ax, x, members, rng)
    labels = [f"{name}\n(n={len(m)}, failed={_failed(m)})" for name, m in groups.items()]
    ax.set_xticks(range(len(groups)), labels)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("TPOT per SLO class (dashed: the class's TPOT SLO)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="best")
    return _save(fig, path)


def default_bin_s(duration_s: float) -> float:
    """About 60 bins over long runs, 1 s bins over shorter ones, 10 bins at the least."""
    return max(duration_s / 60.0, min(1.0, duration_s / 10.0))


def _token_times(record: RequestRecord) -> list[tuple[float, int]]:
    # a record without chunks still delivered its tokens: count them at its finish
    if record.chunks:
        return record.chunks
    assert record.finish_s is not None
    return [(record.finish_s, record.num_output_tokens)]


def throughput_series(
    records: Sequence[RequestRecord], bin_s: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin edges in s, throughput, goodput in tok/s per bin), from time 0 to the last token.

    Throughput counts the output tokens of completed requests, goodput those of the requests that
    met their SLO. Empty arrays when no completed request delivered a token.
    """
    events = [(t, n, meets_slo(r)) for r in records if r.is_completed for t, n in _token_times(r)]
    events = [e for e in events if e[1] > 0]
    if not events:
        return np.array([]), np.array([]), np.array([])
    end = max(t for t, _, _ in events)
    width = bin_s if bin_s is not None else default_bin_s(end) if end > 0 else 1.0
    edges = np.arange(0.0, end + width, width)
    if edges[-1] <= end:  # the last token must fall inside the last bin
        edges = np.append(edges, edges[-1] + width)
    times = np.array([t for t, _, _ in events])
    tokens = np.array([n for _, n, _ in events], dtype=float)
    good = np.array([n if met else 0 for _, n, met in events], dtype=float)
    through, _ = np.histogram(times, bins=edges, weights=tokens)
    goodput, _ = np.histogram(times, bins=edges, weights=good)
    return edges, through / width, goodput / width


def mark_arrivals(ax: Axes, records: Sequence[RequestRecord]) -> None:
    """A short tick at the foot of the plot per request arrival (red: the request failed)."""
    for failed, color in ((False, "black"), (True, "tab:red")):
        times = [r.arrival_s for r in records if r.is_completed != failed]
        if times:
            label = "arrival (failed)" if failed else "arrival"
            # x in data units, y in axes units: the ticks stay at the foot whatever the scale
            ax.vlines(times, 0.0, 0.04, colors=color, linewidth=0.8, label=label,
                      transform=ax.get_xaxis_transform())  # fmt: skip


def plot_throughput(path: Path, records: Sequence[RequestRecord]) -> Path:
    """Throughput and goodput (tok/s) over the run, arrivals marked at the foot."""
    fig, ax = plt.subplots(figsize=(10, 4))
    edges, through, goodput = throughput_series(records)
    if len(edges) == 0:
        no_data(ax, "Output throughput over time")
        return _save(fig, path)
    ax.stairs(through, edges, label="throughput", color="tab:blue", linewidth=1.5)
    ax.stairs(goodput, edges, label="goodput (met SLO)", color="tab:green", fill=True, alpha=0.4)
    mark_arrivals(ax, records)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Output throughput over time ({edges[1] - edges[0]:.2g} s bins)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, path)


def plot_all(out_dir: Path, records: Sequence[RequestRecord]) -> list[Path]:
    """All the report's plots into `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    return [
        plot_latency_cdfs(out_dir / LATENCY_CDFS, records),
        plot_tpot_slo(out_dir / TPOT_SLO, records),
        plot_throughput(out_dir / THROUGHPUT, records),
    ]
