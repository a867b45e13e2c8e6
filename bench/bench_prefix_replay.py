"""One trace replayed through the services with prefix caching on and off, in turns.

For each setting in `--settings` (default off,on,off,on: alternating, so that a change in the
machine's load falls on both) the services start fresh (`python -m services all --drafts
<draft> --threads 2`, a cell of their own on the system Redis, as `bench.scheduling.real`
starts them) with `AUGURY_ENGINE__ENABLE_PREFIX_CACHING` set and the one draft `--draft` as the
only configured model draft (`AUGURY_MODELS__DRAFTS`), or, with `--draft default`, the
model set's drafts as the services serve them by default (`draft-e` first, the others,
`ngram`). The trace is replayed open-loop (`tools.load.client.replay`), each run's report
written as `tools.replay run` writes it (so `python -m tools.replay compare` reads the run
directories), and the gateway's
`augury_prefix_cache_{hits,queries}_total` read before and after the replay (the difference:
the replay's own; the readiness probe's one-token request is left out).

Printed: per run, throughput (output tokens/s from the first arrival to the last finish, as the
replay report counts it), mean end-to-end latency and TTFT, the hit rate; then on's mean over
off's mean for throughput and mean latency.

    python -m bench.bench_prefix_replay --trace shared-1000.jsonl --duration 150 --out runs/prefix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.scheduling.real import read_cell, running
from shared.model.model_set import REPO_ROOT
from tools.load.client import replay
from tools.load.readers import read_trace
from tools.load.report import write_report
from tools.load.trace import TraceRequest

HITS = "augury_prefix_cache_hits_total"
QUERIES = "augury_prefix_cache_queries_total"
SETTINGS = {"on": "true", "off": "false"}
DEFAULT = "default"  # --draft: the drafts the services serve by default


@dataclass(frozen=True)
class Run:
    name: str
    caching: str  # on / off
    requests: int
    completed: int
    throughput_tok_s: float | None
    mean_e2e_s: float | None
    mean_ttft_s: float | None
    duration_s: float | None
    hits: float
    queries: float

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


def counters(text: str) -> dict[str, float]:
    """The prefix-cache counters of a Prometheus text exposition (0 where absent)."""
    found = {HITS: 0.0, QUERIES: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] = sample.value
    return found


async def read_counters(base_url: str) -> dict[str, float]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{base_url}/metrics") as response,
    ):
        response.raise_for_status()
        return counters(await response.text())


def ratio(runs: Sequence[Run], field: str) -> float | None:
    """Mean of `field` over the runs with caching on, over its mean with caching off."""
    means = {}
    for caching in SETTINGS:
        values = [getattr(r, field) for r in runs if r.caching == caching]
        values = [v for v in values if v is not None]
        if not values:
            return None
        means[caching] = statistics.fmean(values)
    return means["on"] / means["off"] if means["off"] else None


def drafts_env(draft: str) -> str:
    return json.dumps([{"name": draft, "dir": str(REPO_ROOT / "models" / "drafts" / draft)}])


def serve(args: argparse.Namespace, index: int, caching: str, trace: Sequence[TraceRequest]) -> Run:
    name = f"{index}-{caching}"
    overrides = {"AUGURY_ENGINE__ENABLE_PREFIX_CACHING": SETTINGS[caching]}
    draft = None if args.draft == DEFAULT else args.draft
    if draft is not None:
        overrides["AUGURY_MODELS__DRAFTS"] = drafts_env(draft)
    with running(
        f"prefix-{name}",
        overrides,
        draft=draft,
        timeout_s=args.request_timeout,
        logs=args.out / "logs",
    ) as services:
        before = asyncio.run(read_counters(services.base_url))
        records = asyncio.run(
            replay(
                trace,
                services.base_url,
                rate_scale=args.rate_scale,
                duration_s=args.duration,
                request_timeout_s=args.request_timeout,
                show_progress=False,
            )
        )
        after = asyncio.run(read_counters(services.base_url))
        asyncio.run(read_cell(services.cell))  # empties the cell's keys
    meta = {"label": f"{name} (caching {caching})", "trace": str(args.trace)}
    summary = write_report(args.out / name, records, meta=meta, plots=False)
    return Run(
        name=name,
        caching=caching,
        requests=summary["requests"],
        completed=summary["completed"],
        throughput_tok_s=summary["throughput_tok_s"],
        mean_e2e_s=summary["e2e_s"]["mean"],
        mean_ttft_s=summary["ttft_s"]["mean"],
        duration_s=summary["duration_s"],
        hits=after[HITS] - before[HITS],
        queries=after[QUERIES] - before[QUERIES],
    )


def show(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(runs: Sequence[Run]) -> None:
    print(
        f"{'run':>6} {'done':>8} {'tok/s':>7} {'mean E2E s':>10} {'mean TTFT s':>11} "
        f"{'span s':>7} {'hits/queries':>17} {'hit rate':>8}"
    )
    for r in runs:
        rate = "-" if r.hit_rate is None else f"{r.hit_rate:.1%}"
        print(
            f"{r.name:>6} {f'{r.completed}/{r.requests}':>8} {show(r.throughput_tok_s, 1):>7} "
            f"{show(r.mean_e2e_s):>10} {show(r.mean_ttft_s):>11} {show(r.duration_s, 0):>7} "
            f"{f'{r.hits:.0f}/{r.queries:.0f}':>17} {rate:>8}"
        )
    print(f"throughput, on / off: {show(ratio(runs, 'throughput_tok_s'), 3)}")
    print(f"mean latency (E2E), on / off: {show(ratio(runs, 'mean_e2e_s'), 3)}")
    print(f"mean TTFT, on / off: {show(ratio(runs, 'mean_ttft_s'), 3)}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="a trace with prompt texts")
    parser.add_argument(
        "--settings", default="off,on,off,on", help="caching per run, in order (on/off)"
    )
    parser.add_argument("--duration", type=float, help="stop sending after S seconds")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="x2: twice as fast")
    parser.add_argument(
        "--draft",
        default=DEFAULT,
        help="the one model draft configured, or 'default': the services' default drafts",
    )
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "bench-prefix-replay")
    args = parser.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",")]
    if unknown := [s for s in args.settings if s not in SETTINGS]:
        parser.error(f"settings are on or off, not {unknown}")
    return args


def main(argv: Sequence[str] | None = None) -> list[Run]:
    args = parse_args(argv)
    trace = read_trace(args.trace, rate=None, seed=0)
    runs = []
    for index, caching in enumerate(args.settings):
        runs.append(serve(args, index, caching, trace))
        print(f"{runs[-1]}", file=sys.stderr, flush=True)
    print_table(runs)
    (args.out / "runs.json").write_text(
        json.dumps([{**asdict(r), "hit_rate": r.hit_rate} for r in runs], indent=2) + "\n"
    )
    return runs


if __name__ == "__main__":
    main()
