"""The request body's option fields as pydantic models, each failure an OpenAI 400 naming its field.

A model's fields are validated in declaration order and the first failure is answered, so the
order below is the order the fields are checked in. JSON `null` means "not sent" (the field's
default) everywhere. Types are strict: `true` is not a number, `1.0` is not an integer. What a
check needs from the server (the vocabulary size, the SLO classes, `gateway.max_n`) comes in the
validation context.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from services.gateway.errors import bad_request
from shared.values.sampling import MAX_BIAS, MAX_LOGPROBS

MAX_PRIORITY = 2**31 - 1

M = TypeVar("M", bound="BodyFields")


def refuse(message: str, param: str | None) -> NoReturn:
    """Inside a validator: fail with this message, answered as a 400 naming `param`."""
    raise PydanticCustomError("bad_request", "{message}", {"message": message, "param": param})


def _param(info: ValidationInfo) -> str:
    prefix = (info.context or {}).get("prefix", "")
    return f"{prefix}{info.field_name}"


def _number(value: Any, info: ValidationInfo) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        refuse(f"{_param(info)} must be a number", _param(info))
    return float(value)


def _integer(value: Any, info: ValidationInfo) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        refuse(f"{_param(info)} must be an integer", _param(info))
    return value


def _flag(value: Any, info: ValidationInfo) -> bool:
    if not isinstance(value, bool):
        refuse(f"{_param(info)} must be a boolean", _param(info))
    return value


Number = Annotated[float, PlainValidator(_number)]
Integer = Annotated[int, PlainValidator(_integer)]
Flag = Annotated[bool, PlainValidator(_flag)]


def token_ids_problem(value: Any, name: str, vocab_size: int) -> str | None:
    """What is wrong with a list of token ids (None: nothing)."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return f"{name} must be a list of token ids"
    if any(not 0 <= t < vocab_size for t in value):
        return f"{name} holds token ids outside [0, {vocab_size})"
    return None


class BodyFields(BaseModel):
    """A group of the body's fields; `read` validates them out of the body."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    @classmethod
    def read(cls: type[M], body: Mapping[str, Any], **context: Any) -> M:
        sent = {name: value for name, value in body.items() if value is not None}
        try:
            return cls.model_validate(sent, context=context)
        except ValidationError as error:
            first = error.errors()[0]
            ctx = first.get("ctx") or {}
            raise bad_request(str(ctx.get("message", first["msg"])), ctx.get("param")) from None


def _top_k(value: Any, info: ValidationInfo) -> int:
    """vLLM's top_k: -1 (and 0) mean no truncation."""
    top_k = _integer(value, info)
    if top_k < -1:
        refuse(f"top_k must be positive, or -1 or 0 for off; got {top_k}", "top_k")
    return 0 if top_k == -1 else top_k


def _stop_token_ids(value: Any, info: ValidationInfo) -> tuple[int, ...]:
    ids = value or []
    problem = token_ids_problem(ids, "stop_token_ids", info.context["vocab_size"])
    if problem is not None:
        refuse(problem, "stop_token_ids")
    return tuple(ids)


def _logit_bias(value: Any, info: ValidationInfo) -> dict[int, float]:
    """OpenAI's map of token ids (JSON string keys) to biases in [-100, 100]."""
    vocab_size = info.context["vocab_size"]
    if not isinstance(value, dict):
        refuse("logit_bias must map token ids to biases", "logit_bias")
    bias = {}
    for key, amount in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < vocab_size):
            refuse(
                f"logit_bias keys are token ids in [0, {vocab_size}), got {key[:32]!r}",
                "logit_bias",
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            refuse("logit_bias values must be numbers", "logit_bias")
        if not -MAX_BIAS <= amount <= MAX_BIAS:  # NaN fails too
            refuse(f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]", "logit_bias")
        bias[int(key)] = float(amount)
    return bias


class SamplingFields(BodyFields):
    """The sampling options and logits processors (the engine checks the ranges again, and its
    errors are answered naming the field too). Context: `vocab_size`."""

    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: Annotated[int, PlainValidator(_top_k)] = 0
    seed: Integer | None = None
    stop_token_ids: Annotated[tuple[int, ...], PlainValidator(_stop_token_ids)] = ()
    ignore_eos: Flag = False
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    min_p: Number = 0.0
    min_tokens: Integer = 0
    logit_bias: Annotated[dict[int, float], PlainValidator(_logit_bias)] = {}


def _logprobs_count(value: Any, info: ValidationInfo) -> int:
    count = _integer(value, info)
    if not 0 <= count <= MAX_LOGPROBS:
        refuse(f"{info.field_name} must be in [0, {MAX_LOGPROBS}]", info.field_name)
    return count


LogprobsCount = Annotated[int, PlainValidator(_logprobs_count)]


class ChatLogprobs(BodyFields):
    """Chat asks with `logprobs: true` and `top_logprobs: N`."""

    top_logprobs: Integer | None = None
    logprobs: Flag = False

    def count(self) -> int | None:
        top = self.top_logprobs
        if top and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        return (top or 0) if self.logprobs else None


class CompletionLogprobs(BodyFields):
    """Completions ask with `logprobs: N` (0: the emitted tokens' own)."""

    logprobs: LogprobsCount | None = None

    def count(self) -> int | None:
        return self.logprobs


class PromptLogprobs(BodyFields):
    """vLLM's `prompt_logprobs: N` (chat and completions)."""

    prompt_logprobs: LogprobsCount | None = None


def _choices(value: Any, info: ValidationInfo) -> int:
    n = _integer(value, info)
    max_n = info.context["max_n"]
    if not 1 <= n <= max_n:
        refuse(f"n must be 1 to {max_n}, got {n}", "n")
    return n


class ChoicesFields(BodyFields):
    """n, and best_of as far as it can be served without logprobs (best_of = n). Context: max_n."""

    n: Annotated[int, PlainValidator(_choices)] = 1
    best_of: Integer | None = None

    def checked(self) -> int:
        best_of, n = self.best_of, self.n
        if best_of is not None and best_of < n:
            raise bad_request(f"best_of ({best_of}) must be at least n ({n})", "best_of")
        if best_of is not None and best_of > n:
            raise bad_request(
                "best_of > n ranks candidates by their cumulative log-probability, which this "
                "server does not compute yet; send best_of equal to n, or leave it out",
                "best_of",
            )
        return n


class MaxTokensFields(BodyFields):
    """Chat's `max_completion_tokens`, then the older `max_tokens` (both checked)."""

    max_completion_tokens: Integer | None = None
    max_tokens: Integer | None = None


class EchoField(BodyFields):
    echo: Flag = False


def _positive_ms(value: Any, info: ValidationInfo) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        refuse("augury.tpot_slo_ms must be a positive number", "augury.tpot_slo_ms")  # NaN too
    return float(value)


def _slo_class(value: Any, info: ValidationInfo) -> str:
    if not isinstance(value, str):
        refuse("augury.slo_class must be a string", "augury.slo_class")
    known = info.context["slo_classes"]
    if value not in known:
        refuse(
            f"unknown SLO class {value[:64]!r}; known: {', '.join(sorted(known))}",
            "augury.slo_class",
        )
    return value


def _draft_model(value: Any, info: ValidationInfo) -> str:
    limit = info.context["max_draft_name_len"]
    if not isinstance(value, str):
        refuse("augury.draft_model must be a string", "augury.draft_model")
    if not 0 < len(value) <= limit:
        refuse(f"augury.draft_model must be 1 to {limit} characters", "augury.draft_model")
    return value


def _app(value: Any, info: ValidationInfo) -> str:
    limit = info.context["max_app_len"]
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        refuse(f"augury.app must be a string of 1 to {limit} characters", "augury.app")
    return value


class AuguryFields(BodyFields):
    """Our extension object (its unknown fields are refused before). Context: `slo_classes`,
    `max_draft_name_len`, `max_app_len`."""

    tpot_slo_ms: Annotated[float, PlainValidator(_positive_ms)] | None = None
    slo_class: Annotated[str, PlainValidator(_slo_class)] | None = None
    draft_model: Annotated[str, PlainValidator(_draft_model)] | None = None
    app: Annotated[str, PlainValidator(_app)] = ""


def _priority(value: Any, info: ValidationInfo) -> int:
    priority = _integer(value, info)
    if abs(priority) > MAX_PRIORITY:
        refuse("priority is out of range", "priority")
    return priority


class PriorityField(BodyFields):
    priority: Annotated[int, PlainValidator(_priority)] = 0


class ServingFlags(BodyFields):
    """The flags of how an answer is sent, gathered from the body, its `stream_options` and its
    `augury` object (each 400 names the flag alone, as vLLM does)."""

    stream: Flag = False
    include_usage: Flag = False
    speculate: Flag = True
    continuous_usage_stats: Flag = False
    include_stop_str_in_output: Flag = False

    @classmethod
    def gather(
        cls, body: Mapping[str, Any], options: Mapping[str, Any], extension: Mapping[str, Any]
    ) -> ServingFlags:
        return cls.read(
            {
                "stream": body.get("stream"),
                "include_usage": options.get("include_usage"),
                "speculate": extension.get("speculate"),
                "continuous_usage_stats": options.get("continuous_usage_stats"),
                "include_stop_str_in_output": body.get("include_stop_str_in_output"),
            }
        )
