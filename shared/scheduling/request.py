"""One request as the scheduler core sees it: token ids, counters, times and statistics.

The same type serves the in-process engine and the scheduler service; neither keeps a request
type of its own. It holds no tensors: where the request's KV lives is the executor's business,
and the core only records whether the executor still has it (`kv`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from shared.values.logprobs import TokenLogprobs
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]
# Where the request's target KV is: in the executor's cache (`kept` there while the request is
# preempted), swapped out to host memory, or dropped (the prompt and output are prefilled again
# when it resumes).
KVState = Literal["resident", "kept", "swapped", "dropped"]


@dataclass
class AcceptanceStats:
    """Speculation counters, as vLLM counts them."""

    num_drafts: int = 0  # verify steps that offered at least one draft token
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_target_forwards: int = 0  # verify steps after prefill (each emits >= 1 token)
    num_draft_layers: int = 0  # tree depths summed over drafts: the drafter's forwards

    def record(self, num_draft_tokens: int, num_accepted: int, depth: int | None = None) -> None:
        """One verify step; `depth`: the verified tree's depth (None: a chain, as deep as its
        tokens)."""
        self.num_target_forwards += 1
        if num_draft_tokens:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft_tokens
            self.num_draft_layers += num_draft_tokens if depth is None else depth
            self.num_accepted += num_accepted
            grow = num_accepted - len(self.accepted_per_position)
            self.accepted_per_position.extend([0] * max(0, grow))
            for pos in range(num_accepted):
                self.accepted_per_position[pos] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        self.num_target_forwards += other.num_target_forwards
        self.num_draft_layers += other.num_draft_layers
        grow = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, grow))
        for pos, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[pos] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward, bonus included (vLLM: 1 + accepted / drafts)."""
        if not self.num_target_forwards:
            return 0.0
        return 1.0 + self.num_accepted / self.num_target_forwards


@dataclass
class Standby:
    """A replica of the draft model a request will most likely move to, kept in step with the
    request's committed tokens ahead of the switch (Spin's fast switching)."""

    model: str
    replica: str
    num_seen: int = 0  # committed tokens that replica holds


@dataclass(eq=False)  # a request is equal only to itself: `in` checks stay O(1) each
class RequestState:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: int = 0  # arrival order in this core
    arrival_time: float = 0.0  # seconds, the executor's clock (the gateway's for the services)
    priority: int = 0  # lower runs sooner (vLLM's convention)
    tpot_slo_ms: float | None = None  # time-per-output-token objective; None: best effort
    slo_class: str | None = None  # the SLO class the request named (or the default class)
    requested_draft: str | None = None  # a draft model the client asked for
    speculate: bool = True  # False: plain decoding for this request
    method: DraftMethod | None = None  # this request's drafting method; None: the core's default
    app: str = ""  # application key (`augury.app`): model-free drafts share a cache within one
    output: list[int] = field(default_factory=list)
    # the target's log-probabilities of `output` (asked with SamplingParams.logprobs)
    logprobs: TokenLogprobs | None = None
    # the target's log-probabilities of the prompt's tokens after the first, gathered chunk by
    # chunk (asked with SamplingParams.prompt_logprobs)
    prompt_logprobs: TokenLogprobs | None = None
    prefill_tokens: list[int] = field(default_factory=list)  # what the target must prefill
    num_prefilled: int = 0
    # prefix caching: the prompt tokens the target found cached (not computed), for the usage;
    # whether the executor's cache was asked since the KV was last dropped
    num_cached_prompt_tokens: int = 0
    prefix_looked_up: bool = False
    num_seen_by_drafter: int = 0  # committed tokens the request's drafter holds
    step: int = 0
    kv: KVState = "resident"
    draft_model: str | None = None  # the model drafting for it now ...
    drafter: str | None = None  # ... on this replica (sticky)
    standby: Standby | None = None  # fast switching: where it will most likely draft next
    # drafters the request switched away from, by model, keeping its committed tokens so that a
    # switch back appends only what they missed (a chooser with `parks_switched`)
    parked: dict[str, Standby] = field(default_factory=dict)
    in_flight: bool = False  # part of a micro-batch on its way through drafters and verifier
    cancelled: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    # times and service, from the `now` the executor passes in
    first_token_time: float | None = None
    last_token_time: float | None = None
    attained_service_ms: float = 0.0  # verifier and drafter time spent on this request
    accepted_lengths: list[int] = field(default_factory=list)  # per decode step, bonus excluded
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    draft_stats: dict[str, AcceptanceStats] = field(default_factory=dict)  # per draft model

    def __post_init__(self) -> None:
        if not self.prefill_tokens:
            self.prefill_tokens = list(self.prompt)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(all_tokens), without building the list."""
        return len(self.prompt) + len(self.output)

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < len(self.prefill_tokens)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens_left(self) -> int:
        return self.params.max_tokens - len(self.output)

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first, so far."""
        if self.first_token_time is None or self.last_token_time is None or len(self.output) < 2:
            return None
        return 1000 * (self.last_token_time - self.first_token_time) / (len(self.output) - 1)

    @property
    def is_on_track(self) -> bool | None:
        """Whether the TPOT so far meets the request's SLO (None: no SLO or too early)."""
        tpot = self.tpot_ms
        if self.tpot_slo_ms is None or tpot is None:
            return None
        return tpot <= self.tpot_slo_ms

    def drop_kv(self) -> None:
        """The executor no longer holds this request's KV: prefill everything again."""
        self.kv = "dropped"
        self.prefill_tokens = self.all_tokens
        self.num_prefilled = 0
        self.prefix_looked_up = False
        self.num_seen_by_drafter = 0
        if self.standby is not None:
            self.standby.num_seen = 0
        for parked in self.parked.values():
            parked.num_seen = 0

    def record_step(
        self,
        num_draft_tokens: int,
        num_accepted: int,
        draft_model: str | None,
        depth: int | None = None,
    ) -> None:
        self.stats.record(num_draft_tokens, num_accepted, depth)
        if num_draft_tokens:
            self.accepted_lengths.append(num_accepted)
            if draft_model is not None:
                self.draft_stats.setdefault(draft_model, AcceptanceStats()).record(
                    num_draft_tokens, num_accepted, depth
                )


def append_tokens(
    req: RequestState, tokens: Sequence[int], eos_token_ids: Collection[int]
) -> list[int]:
    """Append committed tokens up to a stop token or max_tokens; sets `finish_reason`.

    A stop token (the request's stop ids, plus EOS unless ignore_eos) ends the request and is not
    emitted.
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
