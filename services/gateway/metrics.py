"""Client-facing metrics, named like vLLM's under our `augury_` prefix."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from shared.bus.cell_stats import QUEUE_TIME_BUCKETS, CellStats
from shared.scheduling.cost_model import ModelProfile

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


PREEMPTION_KINDS = ("kept", "swapped", "recomputed")


class PreemptionTotals(Collector):
    """The cell's preemptions by kind, as the scheduler counts them in Redis (read at scrape):
    `kept` (KV left in place), `swapped` (to host memory), `recomputed` (KV dropped)."""

    def __init__(self) -> None:
        self.totals: Tally[str] = Tally()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "augury_num_preemptions",
            "Preempted requests, by what happened to their KV.",
            labels=["kind"],
        )
        for kind in sorted({*PREEMPTION_KINDS, *self.totals}):
            family.add_metric([kind], self.totals[kind])
        yield family


class CellLoad(Collector):
    """The cell's load as its scheduler and model services published it (read at scrape):
    vLLM's `num_requests_waiting`, the scheduler's running batch, the KV-cache usage of each
    model service replica and the queue-time histogram. Gauges are left out while no live
    scheduler (or model service) has published."""

    def __init__(self) -> None:
        self.stats = CellStats()

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats.waiting is not None and stats.running is not None:
            yield GaugeMetricFamily(
                "augury_num_requests_waiting",
                "Requests the cell's scheduler holds waiting for admission.",
                value=stats.waiting,
            )
            yield GaugeMetricFamily(
                "augury_scheduler_num_requests_running",
                "Requests in the cell's scheduler's running batch (all gateways').",
                value=stats.running,
            )
        usage = GaugeMetricFamily(
            "augury_kv_cache_usage_perc",
            "KV-cache usage of a model service replica (1 = full): role is target or "
            "draft:<model>.",
            labels=["role", "replica"],
        )
        for (role, replica), share in sorted(stats.kv_usage.items()):
            usage.add_metric([role, replica], share)
        yield usage
        cumulative, running_total = [], 0
        for bound, n in zip((*QUEUE_TIME_BUCKETS, float("inf")), stats.queue_buckets, strict=True):
            running_total += n
            cumulative.append((_bucket_label(bound), running_total))
        yield HistogramMetricFamily(
            "augury_request_queue_time_seconds",
            "Time from a request's submit to its first micro-batch in the scheduler.",
            buckets=cumulative,
            sum_value=stats.queue_sum_s,
        )


def _bucket_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.preemptions = PreemptionTotals()
        r.register(self.preemptions)
        self.cell_load = CellLoad()
        r.register(self.cell_load)
        self._add_cell_metrics(r)
        self._add_latency_metrics(r)
        self._add_request_metrics(r)
        self._add_speculation_metrics(r)

    def _add_cell_metrics(self, r: CollectorRegistry) -> None:
        """Aborts and the model services' cost profiles."""
        self.aborted = Counter(
            "augury_num_requests_aborted",
            "Requests of this gateway that ended without finishing: the client left, or the "
            "cell aborted them (finish reason abort).",
            registry=r,
        )
        self.cost_forward_ms = Gauge(
            "augury_cost_forward_ms",
            "Measured forward latency of a model service (its cost profile): role is target or "
            "draft:<model>, tokens the forward's token count, context the per-request context.",
            ["role", "tokens", "context"],
            registry=r,
        )
        self.cost_profile_info = Gauge(
            "augury_cost_profile_info",
            "The cost profile in force per model role (value 1): source is stored (a profile "
            "file), measured (a quick one that passed the checks), suspect (measured, failed "
            "the checks, not cached) or none; published 0 means the scheduler does not use it.",
            ["role", "source", "published"],
            registry=r,
        )

    def _add_latency_metrics(self, r: CollectorRegistry) -> None:
        """Latencies, and the requests in flight."""
        self.time_to_first_token = Histogram(
            "augury_time_to_first_token_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "augury_inter_token_latency_seconds",
            "Time between streamed token chunks, per token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "augury_e2e_request_latency_seconds",
            "End-to-end request latency.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "augury_num_requests_running",
            "Requests this gateway is serving (queued or running in the cell).",
            registry=r,
        )

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Tokens and finished requests, by outcome."""
        self.prompt_tokens = Counter(
            "augury_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        # vLLM's prefix-cache counters, in prompt tokens of finished requests
        self.prefix_cache_queries = Counter(
            "augury_prefix_cache_queries",
            "Prompt tokens looked up in the target's prefix cache.",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "augury_prefix_cache_hits",
            "Prompt tokens found in the target's prefix cache.",
            registry=r,
        )
        self.generation_tokens = Counter(
            "augury_generation_tokens", "Generated tokens.", registry=r
        )
        self.requests = Counter(
            "augury_request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.recording_failures = Counter(
            "augury_recording_failures",
            "Finished requests that could not be recorded (gateway.record_requests).",
            registry=r,
        )
        self.slo_requests = Counter(
            "augury_slo_requests",
            "Finished requests with a TPOT objective, by SLO class (custom: an objective in ms "
            "only) and whether their TPOT met it (fewer than 2 tokens: met).",
            ["slo_class", "attained"],
            registry=r,
        )

    def _add_speculation_metrics(self, r: CollectorRegistry) -> None:
        """vLLM's speculative-decoding counters."""
        self.spec_drafts = Counter(
            "augury_spec_decode_num_drafts", "Verification steps that checked a draft.", registry=r
        )
        self.spec_draft_tokens = Counter(
            "augury_spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "augury_spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "augury_spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position.",
            ["position"],
            registry=r,
        )


def export_profiles(metrics: GatewayMetrics, profiles: dict[str, ModelProfile]) -> None:
    """Set the cost gauges from the published profiles (one sample per measured grid point)."""
    metrics.cost_forward_ms.clear()
    for role, profile in profiles.items():
        curve = profile.curve
        for i, tokens in enumerate(curve.tokens):
            for j, context in enumerate(curve.contexts):
                gauge = metrics.cost_forward_ms.labels(role, str(tokens), str(context))
                gauge.set(curve.ms_grid[i][j])


def export_profile_statuses(metrics: GatewayMetrics, statuses: dict[str, dict[str, str]]) -> None:
    """Set `augury_cost_profile_info` from the statuses the model services published."""
    metrics.cost_profile_info.clear()
    for role, status in statuses.items():
        published = "1" if status.get("published") == "1" else "0"
        metrics.cost_profile_info.labels(role, status.get("source", "none"), published).set(1)
