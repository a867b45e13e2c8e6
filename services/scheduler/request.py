"""A request in the scheduler's pool: the engine's `Request` plus what the services need.

The scheduler only holds token ids and counters, never tensors. `prefill_tokens` is what the
verifier must compute before the request can decode: the prompt, or prompt and output after the
verifier dropped its KV (preemption by recomputation).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from shared.engine.spec_engine import Request
from shared.wire import FinishReason, Submit

FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


@dataclass(eq=False)
class PoolRequest(Request):
    reply_to: str = ""
    arrival: int = 0  # arrival order in this scheduler
    arrival_time: float = 0.0  # gateway's wall clock
    priority: int = 0
    tpot_slo_ms: float | None = None
    requested_draft: str | None = None
    speculate: bool = True
    prefill_tokens: list[int] = field(default_factory=list)
    draft_model: str | None = None  # the model drafting for it now ...
    drafter: str | None = None  # ... on this replica (sticky)
    in_flight: bool = False  # part of a micro-batch on its way through drafters and verifier
    cancelled: bool = False
    emitted: int = 0  # completion tokens sent to the client

    @classmethod
    def from_submit(cls, submit: Submit, seed: int, arrival: int) -> PoolRequest:
        prompt = list(submit.prompt)
        return cls(
            request_id=submit.request_id,
            prompt=prompt,
            params=submit.sampling,
            seed=seed,
            reply_to=submit.reply_to,
            arrival=arrival,
            arrival_time=submit.arrival_time,
            priority=submit.priority,
            tpot_slo_ms=submit.tpot_slo_ms,
            requested_draft=submit.draft_model,
            speculate=submit.speculate,
            prefill_tokens=prompt,
        )

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < len(self.prefill_tokens)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def recompute(self) -> None:
        """The verifier lost (or had to drop) this request's KV: prefill everything again."""
        self.prefill_tokens = self.all_tokens
        self.num_prefilled = 0


def append_tokens(req: Request, tokens: Sequence[int], eos_token_ids: Collection[int]) -> list[int]:
    """Append committed tokens up to a stop token or max_tokens; sets `finish_reason`.

    The same rule as the in-process engine: a stop token (the request's stop ids, plus EOS
    unless ignore_eos) ends the request and is not emitted.
    """
    stops = set(req.params.stop_token_ids)
    if not req.params.ignore_eos:
        stops |= set(eos_token_ids)
    appended: list[int] = []
    for token in tokens:
        if token in stops:
            req.finish_reason = "stop"
            break
        req.output.append(token)
        appended.append(token)
        if req.tokens_left == 0:
            req.finish_reason = "length"
            break
    return appended
