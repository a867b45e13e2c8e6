"""The load-test report: metrics over `RequestRecord`s, and the files a run leaves behind.

`summarize` computes the numbers (as vLLM's serving benchmark defines them, plus SLO attainment
and goodput); `write_report` writes `report.json`, `records.jsonl`, `report.md` and the PNG plots
(`tools.load.plots`) into a directory; `load_records` reads `records.jsonl` back so a report can
be recomputed or compared (`tools.load.compare`).

Latencies (TTFT, TPOT, ITL, E2E) are taken over completed requests only, as vLLM does; failed
requests count in `requests`/`failed` and as SLO misses, and `failures_by_reason` counts them by
their error (the HTTP status and the server's message, or what else ended them). Every
statistic is a dict of `count`, `mean`, `p50`, `p90`, `p99`, with None (never NaN) when there is
nothing to measure.

    python -m tools.load.report RUN_DIR   # recompute RUN_DIR's report from its records.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tools.load.records import (
    NO_GROUP,
    RequestRecord,
    e2e_s,
    itls_ms,
    meets_slo,
    tpot_ms,
    ttft_s,
)

PERCENTILES = (50, 90, 99)
REPORT_JSON = "report.json"
RECORDS_JSONL = "records.jsonl"
REPORT_MD = "report.md"
MAX_REASON_CHARS = 200


# --- aggregation --------------------------------------------------------------------------


def stats(values: Sequence[float]) -> dict[str, Any]:
    """count, mean and the p50/p90/p99 percentiles (numpy's linear interpolation, like vLLM)."""
    if not values:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    out: dict[str, Any] = {"count": len(values), "mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def run_duration_s(records: Sequence[RequestRecord]) -> float | None:
    """From the first arrival to the last finish (failures included); None without a finish."""
    finishes = [r.finish_s for r in records if r.finish_s is not None]
    if not records or not finishes:
        return None
    return max(finishes) - min(r.arrival_s for r in records)


def _rate(amount: float, duration_s: float | None) -> float | None:
    if duration_s is None or duration_s <= 0:
        return None
    return amount / duration_s


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _collect(
    records: Sequence[RequestRecord], metric: Callable[[RequestRecord], float | None]
) -> list[float]:
    values = (metric(r) for r in records)
    return [v for v in values if v is not None]


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The `ttft_s`, `tpot_ms`, `itl_ms` and `e2e_s` statistics of some requests."""
    return {
        "ttft_s": stats(_collect(records, ttft_s)),
        "tpot_ms": stats(_collect(records, tpot_ms)),
        "itl_ms": stats([itl for r in records for itl in itls_ms(r)]),
        "e2e_s": stats(_collect(records, e2e_s)),
    }


def group_summary(records: Sequence[RequestRecord], duration_s: float | None) -> dict[str, Any]:
    """Counts, latencies, SLO attainment and token rates of some requests over `duration_s`."""
    completed = [r for r in records if r.is_completed]
    met = [r for r in records if meets_slo(r)]
    slos = sorted({r.tpot_slo_ms for r in records if r.tpot_slo_ms is not None})
    return {
        "requests": len(records),
        "completed": len(completed),
        "failed": len(records) - len(completed),
        "tpot_slos_ms": slos,
        "slo_met": len(met),
        "slo_attainment": _share(len(met), len(records)),
        "goodput_tok_s": _rate(sum(r.num_output_tokens for r in met), duration_s),
        "throughput_tok_s": _rate(sum(r.num_output_tokens for r in completed), duration_s),
        **latency_summary(records),
    }


def _grouped(
    records: Sequence[RequestRecord],
    key: Callable[[RequestRecord], str | None],
    duration_s: float | None,
) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(key(r) or NO_GROUP, []).append(r)
    return {name: group_summary(groups[name], duration_s) for name in sorted(groups)}


def failure_reason(record: RequestRecord) -> str:
    """Why a failed request failed, as the report counts it: its error, cut to one short line."""
    text = " ".join((record.error or "no answer").split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def failures_by_reason(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests counted by `failure_reason`, the most frequent first."""
    counts = Counter(failure_reason(r) for r in records if not r.is_completed)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def speculation_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """vLLM's speculative counters summed over all requests, and what they give."""
    drafts = sum(r.drafts for r in records)
    draft_tokens = sum(r.draft_tokens for r in records)
    accepted = sum(r.accepted_tokens for r in records)
    steps: Counter[str] = Counter()
    for r in records:
        steps.update(r.steps_by_draft)
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "steps_by_draft": dict(sorted(steps.items())),
    }


def summarize(
    records: Sequence[RequestRecord], *, duration_s: float | None = None
) -> dict[str, Any]:
    """Every number of the report (see the module docstring); JSON-ready, without NaN."""
    duration = duration_s if duration_s is not None else run_duration_s(records)
    overall = group_summary(records, duration)
    completed_tokens = sum(r.num_output_tokens for r in records if r.is_completed)
    summary = {
        "requests": overall.pop("requests"),
        "completed": overall.pop("completed"),
        "failed": overall.pop("failed"),
        "failures_by_reason": failures_by_reason(records),
        "duration_s": duration,
        "total_prompt_tokens": sum(r.num_prompt_tokens for r in records if r.is_completed),
        "total_output_tokens": completed_tokens,
        "request_throughput": _rate(len([r for r in records if r.is_completed]), duration),
        **overall,
        **speculation_summary(records),
        "per_class": _grouped(records, lambda r: r.slo_class, duration),
        "per_kind": _grouped(records, lambda r: r.kind, duration),
    }
    return _finite(summary)


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --- files --------------------------------------------------------------------------------


def write_report(
    out_dir: Path,
    records: Sequence[RequestRecord],
    *,
    meta: dict[str, Any] | None = None,
    duration_s: float | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Write report.json, records.jsonl, report.md (and the PNG plots) into `out_dir`.

    `meta` (command, trace, settings, `label` for `tools.load.compare`) goes under "meta" in
    report.json. Returns the summary, without "meta".
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, duration_s=duration_s)
    report = {**summary, "meta": _finite(meta or {})}
    (out_dir / REPORT_JSON).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    with (out_dir / RECORDS_JSONL).open("w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")
    plot_files: list[str] = []
    if plots:
        from tools.load.plots import plot_all  # matplotlib only when plots are asked for

        plot_files = [p.name for p in plot_all(out_dir, records)]
    (out_dir / REPORT_MD).write_text(markdown(summary, meta=meta, plot_files=plot_files))
    return summary


def load_records(run_dir: Path) -> list[RequestRecord]:
    """The records a `write_report` left in `run_dir` (its records.jsonl)."""
    path = Path(run_dir) / RECORDS_JSONL
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {RECORDS_JSONL}")
    lines = path.read_text().splitlines()
    return [RequestRecord.from_json(json.loads(line)) for line in lines if line.strip()]


def load_report(run_dir: Path) -> dict[str, Any]:
    """The report.json a `write_report` left in `run_dir`."""
    path = Path(run_dir) / REPORT_JSON
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {REPORT_JSON} (not a load-test report directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


# --- Markdown -----------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    """A number for a table: `value * scale` with `digits` decimals, "-" for None."""
    return "-" if value is None else f"{value * scale:.{digits}f}"


def pct(value: float | None) -> str:
    """A share as a percentage, "-" for None."""
    return fmt(value, 1, 100.0) + ("%" if value is not None else "")


# (summary key, row label, scale into the unit of the label)
LATENCY_ROWS = (
    ("ttft_s", "TTFT (ms)", 1000.0),
    ("tpot_ms", "TPOT (ms)", 1.0),
    ("itl_ms", "ITL (ms)", 1.0),
    ("e2e_s", "E2E (s)", 1.0),
)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _overview_rows(s: dict[str, Any]) -> list[list[str]]:
    return [
        ["requests", str(s["requests"])],
        ["completed", str(s["completed"])],
        ["failed", str(s["failed"])],
        ["duration (s)", fmt(s["duration_s"])],
        ["SLO attainment", pct(s["slo_attainment"])],
        ["goodput (tok/s)", fmt(s["goodput_tok_s"], 1)],
        ["throughput (tok/s)", fmt(s["throughput_tok_s"], 1)],
        ["request throughput (req/s)", fmt(s["request_throughput"], 3)],
        ["mean accepted length", fmt(s["mean_accepted_length"], 3)],
        ["acceptance rate", pct(s["acceptance_rate"])],
    ]


def _latency_rows(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key, label, scale in LATENCY_ROWS:
        st = s[key]
        cells = [fmt(st[q], 2, scale) for q in ("mean", "p50", "p90", "p99")]
        rows.append([label, str(st["count"]), *cells])
    return rows


def _group_rows(groups: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for name, g in groups.items():
        slos = ", ".join(fmt(v, 0) for v in g["tpot_slos_ms"]) or "-"
        rows.append(
            [
                name,
                str(g["requests"]),
                str(g["failed"]),
                slos,
                pct(g["slo_attainment"]),
                fmt(g["goodput_tok_s"], 1),
                fmt(g["ttft_s"]["mean"], 2, 1000.0),
                fmt(g["tpot_ms"]["mean"]),
                fmt(g["tpot_ms"]["p99"]),
                fmt(g["e2e_s"]["mean"]),
            ]
        )
    return rows


GROUP_HEADER = (
    "requests",
    "failed",
    "TPOT SLO (ms)",
    "attainment",
    "goodput (tok/s)",
    "mean TTFT (ms)",
    "mean TPOT (ms)",
    "p99 TPOT (ms)",
    "mean E2E (s)",
)


def _meta_lines(meta: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in meta.items():
        shown = value if isinstance(value, str) else json.dumps(value)
        lines.append(f"- **{key}**: `{shown}`")
    return lines


def markdown(
    summary: dict[str, Any],
    *,
    meta: dict[str, Any] | None = None,
    plot_files: Sequence[str] = (),
) -> str:
    """The readable report: overview, latency percentiles, per class / kind / draft, plots."""
    title = (meta or {}).get("label")
    lines = [f"# Load test: {title}" if title else "# Load test report", ""]
    if meta:
        lines += [*_meta_lines(meta), ""]
    lines += ["## Overview", "", *_table(["metric", "value"], _overview_rows(summary)), ""]
    failures = summary.get("failures_by_reason") or {}
    if failures:
        rows = [[str(n), reason.replace("|", "\\|")] for reason, n in failures.items()]
        lines += ["## Failures", "", *_table(["requests", "reason"], rows), ""]
    header = ["metric", "count", "mean", "p50", "p90", "p99"]
    lines += ["## Latency", "", *_table(header, _latency_rows(summary)), ""]
    lines += ["Latencies are over completed requests; failed ones count as SLO misses.", ""]
    for key, title_ in (("per_class", "SLO class"), ("per_kind", "kind")):
        if summary[key]:
            rows = _group_rows(summary[key])
            lines += [f"## Per {title_}", "", *_table([title_, *GROUP_HEADER], rows), ""]
    if summary["steps_by_draft"]:
        rows = [[name, str(n)] for name, n in summary["steps_by_draft"].items()]
        lines += ["## Steps by draft", "", *_table(["draft", "steps"], rows), ""]
    if plot_files:
        lines += ["## Plots", ""] + [f"![{name}]({name})" for name in plot_files] + [""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Recompute a load-test report from its records")
    parser.add_argument("run_dir", type=Path, help="a directory holding records.jsonl")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = parser.parse_args(argv)
    records = load_records(args.run_dir)
    # keep the old report's meta and duration (a run may have set the duration explicitly)
    old = load_report(args.run_dir) if (args.run_dir / REPORT_JSON).is_file() else {}
    meta, duration = old.get("meta"), old.get("duration_s")
    write_report(args.run_dir, records, meta=meta, duration_s=duration, plots=not args.no_plots)
    print((args.run_dir / REPORT_MD).read_text())


if __name__ == "__main__":
    main()
