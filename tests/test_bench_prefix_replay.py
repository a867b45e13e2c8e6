"""bench.bench_prefix_replay's reading of the gateway's counters and its on/off ratios (the
replay itself needs the services: see docs/prefix-caching.md, Benchmarks)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from bench.bench_prefix_replay import HITS, QUERIES, Run, counters, parse_args, ratio
from services.gateway.metrics import GatewayMetrics


def test_counters_read_the_gateways_exposition() -> None:
    metrics = GatewayMetrics()
    metrics.prefix_cache_queries.inc(1049)
    metrics.prefix_cache_hits.inc(1008)
    found = counters(generate_latest(metrics.registry).decode())
    assert found == {HITS: 1008.0, QUERIES: 1049.0}


def run(caching: str, tok_s: float, e2e_s: float) -> Run:
    return Run(f"x-{caching}", caching, 4, 4, tok_s, e2e_s, 1.0, 10.0, 0.0, 0.0)


def test_ratio_is_the_mean_on_over_the_mean_off() -> None:
    runs = [run("off", 10.0, 100.0), run("on", 24.0, 20.0), run("off", 14.0, 60.0)]
    runs.append(run("on", 26.0, 30.0))
    assert ratio(runs, "throughput_tok_s") == pytest.approx(25.0 / 12.0)
    assert ratio(runs, "mean_e2e_s") == pytest.approx(25.0 / 80.0)
    assert ratio(runs[:1], "mean_e2e_s") is None  # no run with caching on


def test_settings_are_on_or_off() -> None:
    assert parse_args(["--trace", "t.jsonl"]).settings == ["off", "on", "off", "on"]
    with pytest.raises(SystemExit):
        parse_args(["--trace", "t.jsonl", "--settings", "on,maybe"])
