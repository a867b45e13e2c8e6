"""What one request did under load: the replay client and the simulator both produce these, and
the report (`tools.load.report`) reads nothing else. The per-request measures (TTFT, TPOT,
end-to-end latency, inter-token latencies, whether the TPOT objective was met) are here too.

Times are seconds from the start of the run (the replay's wall clock, or the simulator's virtual
clock), so a real replay and a simulation of the same trace compare field by field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    index: int  # the request's position in the trace
    arrival_s: float  # when it was (to be) sent
    num_prompt_tokens: int
    kind: str | None = None
    slo_class: str | None = None
    tpot_slo_ms: float | None = None  # None: no objective (met whenever it completes)
    first_token_s: float | None = None  # first output token received
    finish_s: float | None = None  # last byte of the answer (or the failure)
    num_output_tokens: int = 0
    finish_reason: str | None = None  # "stop", "length"; None when it failed
    error: str | None = None  # why it failed; None when it completed
    # arrival time and token count of each chunk of output, in order
    chunks: list[tuple[float, int]] = field(default_factory=list)
    # speculation, as the server reported it (vLLM's counters)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps_by_draft: dict[str, int] = field(default_factory=dict)  # draft model -> steps served

    @property
    def is_completed(self) -> bool:
        return self.error is None and self.finish_s is not None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        data = dict(data)
        data["chunks"] = [(float(t), int(n)) for t, n in data.get("chunks", [])]
        return cls(**data)


NO_GROUP = "none"  # the per_class / per_kind key of requests without a class / kind


def ttft_s(record: RequestRecord) -> float | None:
    """Time to first token; None unless the request completed."""
    if not record.is_completed or record.first_token_s is None:
        return None
    return record.first_token_s - record.arrival_s


def tpot_ms(record: RequestRecord) -> float | None:
    """Time per output token after the first (ms); None unless completed with > 1 token."""
    if not record.is_completed or record.first_token_s is None or record.num_output_tokens < 2:
        return None
    assert record.finish_s is not None
    return 1000.0 * (record.finish_s - record.first_token_s) / (record.num_output_tokens - 1)


def e2e_s(record: RequestRecord) -> float | None:
    """End-to-end latency, arrival to the last byte; None unless the request completed."""
    if not record.is_completed:
        return None
    assert record.finish_s is not None
    return record.finish_s - record.arrival_s


def itls_ms(record: RequestRecord) -> list[float]:
    """Inter-token latencies (ms) of a completed request, one value per token after the first chunk.

    vLLM records one ITL per streamed chunk; here a chunk that carried n tokens (speculative
    decoding delivers several at once) contributes its gap to the previous chunk n times, divided
    by n, so every token weighs the same and the mean ITL matches TPOT when the first chunk holds
    one token. The first chunk's tokens are covered by TTFT; chunks without tokens are skipped.
    """
    if not record.is_completed:
        return []
    chunks = [(t, n) for t, n in record.chunks if n > 0]
    out: list[float] = []
    for (prev_t, _), (t, n) in zip(chunks, chunks[1:], strict=False):
        out.extend([1000.0 * (t - prev_t) / n] * n)
    return out


def meets_slo(record: RequestRecord) -> bool:
    """Whether the request completed within its TPOT objective.

    Failed requests miss; a completed request without an objective, or with a single output token
    (no TPOT), meets it.
    """
    if not record.is_completed:
        return False
    tpot = tpot_ms(record)
    return record.tpot_slo_ms is None or tpot is None or tpot <= record.tpot_slo_ms
