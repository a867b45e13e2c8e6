"""Messages between gateways and the scheduler, and service heartbeats.

Gateway -> scheduler on the cell's request stream: `Submit`, `Cancel`.
Scheduler -> the gateway named in `Submit.reply_to`: `Tokens`, `RequestError`.
Fields marked `Sparse` were added after version 1 and are written only when set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.values.logprobs import TokenLogprobs
from shared.values.sampling import SamplingParams
from shared.values.steps import MAX_APP_LEN, MAX_ID_LEN, check_request_id
from shared.wire.base import WireMessage
from shared.wire.schema import (
    Flag,
    Float,
    Int,
    OptFloat,
    OptInt,
    OptText,
    Sparse,
    Text,
    TokenIds,
    wire,
)
from shared.wire.values import FINISH, LOGPROBS, SAMPLING, FinishReason

MAX_DRAFT_NAME_LEN = 64  # a draft model's name in a Submit
MAX_SLO_CLASS_LEN = 64  # an SLO class's name in a Submit or Tokens
MAX_MESSAGE_LEN = 4096


def check_slo_class(slo_class: str | None) -> None:
    if slo_class is not None and not 0 < len(slo_class) <= MAX_SLO_CLASS_LEN:
        raise ValueError(f"SLO class names are 1 to {MAX_SLO_CLASS_LEN} characters")


@dataclass(frozen=True)
class Submit(WireMessage):
    """A new request, tokenized by the gateway (prompt ids travel as packed int32)."""

    TYPE: ClassVar[str] = "submit"
    request_id: str = wire(Text(MAX_ID_LEN))
    prompt: tuple[int, ...] = wire(TokenIds())
    sampling: SamplingParams = wire(SAMPLING)
    # stream the scheduler appends this request's Tokens / RequestError to
    reply_to: str = wire(Text())
    arrival_time: float = wire(Float())  # gateway's wall clock, seconds since the epoch
    priority: int = wire(Int(minimum=None), 0)  # lower runs sooner (vLLM's convention)
    # time-per-output-token objective; None: best effort
    tpot_slo_ms: float | None = wire(OptFloat(), None)
    # a configured draft model's name; None: scheduler picks
    draft_model: str | None = wire(OptText(MAX_DRAFT_NAME_LEN), None)
    speculate: bool = wire(Flag(), True)  # False: plain decoding, no drafts
    slo_class: str | None = wire(Sparse(OptText(MAX_SLO_CLASS_LEN)), None)  # a configured class
    app: str = wire(Sparse(Text(MAX_APP_LEN)), "")  # the request's application key (`augury.app`)

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if len(self.app) > MAX_APP_LEN:
            raise ValueError(f"app is at most {MAX_APP_LEN} characters")
        if not self.prompt:
            raise ValueError("a prompt has at least one token")
        if self.tpot_slo_ms is not None and self.tpot_slo_ms <= 0:
            raise ValueError("tpot_slo_ms must be positive")
        check_slo_class(self.slo_class)


@dataclass(frozen=True)
class Cancel(WireMessage):
    """Stop a request and free what it holds (client gone, or the gateway gave up)."""

    TYPE: ClassVar[str] = "cancel"
    request_id: str = wire(Text(MAX_ID_LEN))
    reason: str = wire(Text(), "client_disconnected")

    def __post_init__(self) -> None:
        check_request_id(self.request_id)


@dataclass(frozen=True)
class Tokens(WireMessage):
    """Tokens a request committed in one step, plus that step's speculation statistics.

    `offset` is the number of completion tokens emitted before these: a reader drops what it has
    already seen (redelivery) and detects gaps. The statistics count this step only
    (vLLM's counters): drafts is 1 when the step verified a draft, else 0. The message that
    finishes a request also carries its SLO class, its resolved TPOT objective and its measured
    TPOT (scheduler clock), and the prompt tokens found in the target's prefix cache, each written
    only when known. `logprobs` (asked with SamplingParams.logprobs; written only when set) holds
    the target's log-probabilities of `token_ids`, one entry each.
    """

    TYPE: ClassVar[str] = "tokens"
    request_id: str = wire(Text(MAX_ID_LEN))
    step: int = wire(Int())
    offset: int = wire(Int())
    token_ids: tuple[int, ...] = wire(TokenIds())
    finish: FinishReason | None = wire(FINISH, None)
    drafts: int = wire(Int(), 0)
    draft_tokens: int = wire(Int(), 0)
    accepted_tokens: int = wire(Int(), 0)
    draft_model: str = wire(Sparse(Text(MAX_ID_LEN)), "")
    slo_class: str | None = wire(Sparse(OptText(MAX_SLO_CLASS_LEN)), None)
    tpot_slo_ms: float | None = wire(Sparse(OptFloat()), None)
    tpot_ms: float | None = wire(Sparse(OptFloat()), None)
    # the finishing message's: prompt tokens the target found in its prefix cache
    cached_tokens: int | None = wire(Sparse(OptInt()), None)
    logprobs: TokenLogprobs | None = wire(Sparse(LOGPROBS), None)
    # the first message's (offset 0), asked with SamplingParams.prompt_logprobs: the target's
    # log-probabilities of the prompt's tokens after the first; written only when set
    prompt_logprobs: TokenLogprobs | None = wire(Sparse(LOGPROBS), None)

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if self.step < 0 or self.offset < 0:
            raise ValueError("step and offset are >= 0")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs need one entry per token")
        if self.cached_tokens is not None and self.cached_tokens < 0:
            raise ValueError("cached_tokens must be >= 0")
        check_slo_class(self.slo_class)
        if self.tpot_slo_ms is not None and not self.tpot_slo_ms > 0:
            raise ValueError("tpot_slo_ms must be positive")
        if self.tpot_ms is not None and not self.tpot_ms >= 0:
            raise ValueError("tpot_ms must be >= 0")


@dataclass(frozen=True)
class RequestError(WireMessage):
    """A request failed; `code` maps to the HTTP status, `param` names the offending field."""

    TYPE: ClassVar[str] = "error"
    request_id: str = wire(Text(MAX_ID_LEN))
    # e.g. invalid_request, context_length_exceeded, overloaded, internal_error
    code: str = wire(Text(64))
    message: str = wire(Text(MAX_MESSAGE_LEN))
    param: str | None = wire(OptText(), None)  # the offending field

    def __post_init__(self) -> None:
        check_request_id(self.request_id)


@dataclass(frozen=True)
class Heartbeat(WireMessage):
    """What a live replica says about itself; stored under a heartbeat key with a TTL."""

    TYPE: ClassVar[str] = "heartbeat"
    service: str = wire(Text(64))  # gateway, scheduler, drafter, verifier
    replica: str = wire(Text(128))
    cell: str = wire(Text(64))
    started_at: float = wire(Float())
    sent_at: float = wire(Float())
    model: str | None = wire(OptText(), None)  # the model a drafter or verifier serves
    capacity: int = wire(Int(), 0)  # how many entries it handles at once
    in_flight: int = wire(Int(), 0)  # how many it is handling now
