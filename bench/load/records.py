"""What one request did under load: the replay client and the simulator both produce these, and
the report (`bench.load.report`) reads nothing else.

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
