"""Messages between gateways and the scheduler, and service heartbeats.

Gateway -> scheduler on the cell's request stream: `Submit`, `Cancel`.
Scheduler -> the gateway named in `Submit.reply_to`: `Tokens`, `RequestError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from shared.values.logprobs import TokenLogprobs
from shared.values.sampling import SamplingParams
from shared.values.steps import MAX_APP_LEN, MAX_ID_LEN, check_request_id
from shared.wire.base import WireMessage
from shared.wire.codec import PayloadReader, pack_ints
from shared.wire.values import (
    FinishReason,
    finish_payload,
    optional_logprobs_payload,
    read_finish,
    read_optional_logprobs,
    read_sampling,
    sampling_payload,
)

MAX_DRAFT_NAME_LEN = 64  # a draft model's name in a Submit
MAX_SLO_CLASS_LEN = 64  # an SLO class's name in a Submit or Tokens
MAX_MESSAGE_LEN = 4096


def check_slo_class(slo_class: str | None) -> None:
    if slo_class is not None and not 0 < len(slo_class) <= MAX_SLO_CLASS_LEN:
        raise ValueError(f"SLO class names are 1 to {MAX_SLO_CLASS_LEN} characters")


def _present(**fields: Any) -> dict[str, Any]:
    """Optional fields added to a message type after its first release, written only when set:
    a message that does not use them encodes byte for byte as before (schema version 1)."""
    return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True)
class Submit(WireMessage):
    """A new request, tokenized by the gateway (prompt ids travel as packed int32)."""

    TYPE: ClassVar[str] = "submit"
    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    reply_to: str  # stream the scheduler appends this request's Tokens / RequestError to
    arrival_time: float  # gateway's wall clock, seconds since the epoch
    priority: int = 0  # lower runs sooner (vLLM's convention)
    tpot_slo_ms: float | None = None  # time-per-output-token objective; None: best effort
    draft_model: str | None = None  # a configured draft model's name; None: scheduler picks
    speculate: bool = True  # False: plain decoding, no drafts
    slo_class: str | None = None  # a configured SLO class's name (written only when set)
    app: str = ""  # the request's application key (`augury.app`; written only when set)

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if len(self.app) > MAX_APP_LEN:
            raise ValueError(f"app is at most {MAX_APP_LEN} characters")
        if not self.prompt:
            raise ValueError("a prompt has at least one token")
        if self.tpot_slo_ms is not None and self.tpot_slo_ms <= 0:
            raise ValueError("tpot_slo_ms must be positive")
        check_slo_class(self.slo_class)

    def payload(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt": pack_ints(self.prompt),
            "sampling": sampling_payload(self.sampling),
            "reply_to": self.reply_to,
            "arrival_time": float(self.arrival_time),
            "priority": int(self.priority),
            "tpot_slo_ms": None if self.tpot_slo_ms is None else float(self.tpot_slo_ms),
            "draft_model": self.draft_model,
            "speculate": bool(self.speculate),
        } | _present(slo_class=self.slo_class, app=self.app or None)

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            request_id=fields.text("request_id", max_len=MAX_ID_LEN),
            prompt=fields.tokens("prompt"),
            sampling=read_sampling(fields.sub("sampling")),
            reply_to=fields.text("reply_to"),
            arrival_time=fields.number("arrival_time"),
            priority=fields.integer("priority", 0),
            tpot_slo_ms=fields.optional_number("tpot_slo_ms"),
            draft_model=fields.optional_text("draft_model", max_len=MAX_DRAFT_NAME_LEN),
            speculate=fields.flag("speculate", True),
            slo_class=fields.optional_text("slo_class", max_len=MAX_SLO_CLASS_LEN),
            app=fields.text("app", "", max_len=MAX_APP_LEN),
        )


@dataclass(frozen=True)
class Cancel(WireMessage):
    """Stop a request and free what it holds (client gone, or the gateway gave up)."""

    TYPE: ClassVar[str] = "cancel"
    request_id: str
    reason: str = "client_disconnected"

    def __post_init__(self) -> None:
        check_request_id(self.request_id)

    def payload(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "reason": self.reason}

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            request_id=fields.text("request_id", max_len=MAX_ID_LEN),
            reason=fields.text("reason", "client_disconnected"),
        )


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
    request_id: str
    step: int
    offset: int
    token_ids: tuple[int, ...]
    finish: FinishReason | None = None
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_model: str = ""
    slo_class: str | None = None
    tpot_slo_ms: float | None = None
    tpot_ms: float | None = None
    logprobs: TokenLogprobs | None = None
    # the finishing message's: prompt tokens the target found in its prefix cache
    cached_tokens: int | None = None
    # the first message's (offset 0), asked with SamplingParams.prompt_logprobs: the target's
    # log-probabilities of the prompt's tokens after the first; written only when set
    prompt_logprobs: TokenLogprobs | None = None

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

    def payload(self) -> dict[str, Any]:
        return (
            {
                "request_id": self.request_id,
                "step": int(self.step),
                "offset": int(self.offset),
                "token_ids": pack_ints(self.token_ids),
                "finish": finish_payload(self.finish),
                "drafts": int(self.drafts),
                "draft_tokens": int(self.draft_tokens),
                "accepted_tokens": int(self.accepted_tokens),
            }
            | _present(
                draft_model=self.draft_model or None,
                slo_class=self.slo_class,
                tpot_slo_ms=None if self.tpot_slo_ms is None else float(self.tpot_slo_ms),
                tpot_ms=None if self.tpot_ms is None else float(self.tpot_ms),
                cached_tokens=None if self.cached_tokens is None else int(self.cached_tokens),
            )
            | optional_logprobs_payload(self.logprobs)
            | optional_logprobs_payload(self.prompt_logprobs, "prompt_logprobs")
        )

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            request_id=fields.text("request_id", max_len=MAX_ID_LEN),
            step=fields.integer("step", minimum=0),
            offset=fields.integer("offset", minimum=0),
            token_ids=fields.tokens("token_ids"),
            finish=read_finish(fields, "finish"),
            drafts=fields.integer("drafts", 0, minimum=0),
            draft_tokens=fields.integer("draft_tokens", 0, minimum=0),
            accepted_tokens=fields.integer("accepted_tokens", 0, minimum=0),
            draft_model=fields.text("draft_model", "", max_len=MAX_ID_LEN),
            slo_class=fields.optional_text("slo_class", max_len=MAX_SLO_CLASS_LEN),
            tpot_slo_ms=fields.optional_number("tpot_slo_ms"),
            tpot_ms=fields.optional_number("tpot_ms"),
            logprobs=read_optional_logprobs(fields),
            cached_tokens=fields.optional_integer("cached_tokens"),
            prompt_logprobs=read_optional_logprobs(fields, "prompt_logprobs"),
        )


@dataclass(frozen=True)
class RequestError(WireMessage):
    """A request failed; `code` maps to the HTTP status, `param` names the offending field."""

    TYPE: ClassVar[str] = "error"
    request_id: str
    code: str  # e.g. invalid_request, context_length_exceeded, overloaded, internal_error
    message: str
    param: str | None = None

    def __post_init__(self) -> None:
        check_request_id(self.request_id)

    def payload(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "code": self.code,
            "message": self.message,
            "param": self.param,
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            request_id=fields.text("request_id", max_len=MAX_ID_LEN),
            code=fields.text("code", max_len=64),
            message=fields.text("message", max_len=MAX_MESSAGE_LEN),
            param=fields.optional_text("param"),
        )


@dataclass(frozen=True)
class Heartbeat(WireMessage):
    """What a live replica says about itself; stored under a heartbeat key with a TTL."""

    TYPE: ClassVar[str] = "heartbeat"
    service: str  # gateway, scheduler, drafter, verifier
    replica: str
    cell: str
    started_at: float
    sent_at: float
    model: str | None = None  # the model a drafter or verifier serves
    capacity: int = 0  # how many entries it handles at once
    in_flight: int = 0  # how many it is handling now

    def payload(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "replica": self.replica,
            "cell": self.cell,
            "started_at": float(self.started_at),
            "sent_at": float(self.sent_at),
            "model": self.model,
            "capacity": int(self.capacity),
            "in_flight": int(self.in_flight),
        }

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        return fields.build(
            cls,
            service=fields.text("service", max_len=64),
            replica=fields.text("replica", max_len=128),
            cell=fields.text("cell", max_len=64),
            started_at=fields.number("started_at"),
            sent_at=fields.number("sent_at"),
            model=fields.optional_text("model"),
            capacity=fields.integer("capacity", 0, minimum=0),
            in_flight=fields.integer("in_flight", 0, minimum=0),
        )
