"""Request bodies of the OpenAI-compatible endpoints: validation and tokenization.

Besides OpenAI's fields we take vLLM's `top_k`, `ignore_eos`, `stop_token_ids` and `priority`
(lower runs sooner), and our own extension object:

    "augury": {"slo_class": "standard", "tpot_slo_ms": 50, "draft_model": "tiny",
               "speculate": true, "app": "code-review"}

`slo_class` names one of `scheduler.slo.classes`: its time-per-output-token objective is that
class's multiple of the machine's baseline latency (shared/scheduling/slo_classes.py).
`tpot_slo_ms` gives the objective in ms and wins over the class's (the class still names the
request's class in metrics); with neither, `scheduler.slo.default_class` applies (none: best
effort). `draft_model` picks one configured draft model (none: the scheduler chooses), and
`speculate: false` turns speculation off for the request. `app` names the request's application
(1 to 128 characters): a model-free `suffix` draft shares its cache of recent sequences only
among the requests that name the same one.

The final chunk of a stream (and a non-streamed answer) carries `augury`: the request's
speculation statistics, and `slo_class`, `tpot_slo_ms` (resolved), `tpot_ms` (measured by the
scheduler) and `slo_met` (null without an objective or with fewer than 2 tokens).

In streams, vLLM's `stream_options: {"continuous_usage_stats": true}` puts `usage` (prompt,
completion so far, total) on every chunk; `include_usage` adds the final usage-only chunk.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from shared.engine.sampling import SamplingParams, refuse_unsupported
from shared.errors import InvalidRequestError, UnsupportedOptionError
from shared.settings import SloSettings
from shared.wire.requests import MAX_APP_LEN, MAX_DRAFT_NAME_LEN

DEFAULT_MAX_TOKENS = 16
MAX_PRIORITY = 2**31 - 1
MAX_STOP_TOKEN_IDS = 64  # default of gateway.max_stop_token_ids
MAX_MESSAGES = 256  # default of gateway.max_messages
SLO_CLASSES = tuple(SloSettings().classes)  # default of scheduler.slo.classes


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class APIError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")


@dataclass(frozen=True)
class GenerationRequest:
    chat: bool
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    tpot_slo_ms: float | None
    draft_model: str | None
    speculate: bool
    continuous_usage: bool = False  # usage on every streamed chunk
    # the prompt as the client sent it, for recording: chat turns, or a completion's text
    messages: tuple[tuple[str, str], ...] | None = None
    prompt_text: str | None = None
    slo_class: str | None = None  # one of scheduler.slo.classes
    app: str = ""  # application key: model-free drafts share a cache within one


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{name} must be a number", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", name)
    return value


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return value


def _token_ids(value: Any, name: str, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise bad_request(f"{name} must be a list of token ids", name)
    if any(not 0 <= t < vocab_size for t in value):
        raise bad_request(f"{name} holds token ids outside [0, {vocab_size})", name)
    return tuple(value)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if _integer(body, "n", 1) != 1:
        raise bad_request("only n=1 is supported", "n")
    try:
        refuse_unsupported(body)  # the engine's list: one list for both
    except UnsupportedOptionError as error:
        raise bad_request(str(error), error.param) from None
    if body.get("stop") not in (None, [], ""):
        raise bad_request("stop strings are not supported; use stop_token_ids", "stop")


def _sampling(
    body: Mapping[str, Any], max_tokens_field: str, vocab_size: int, max_stop_token_ids: int
) -> SamplingParams:
    max_tokens = _integer(body, max_tokens_field, None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    stop_ids = body.get("stop_token_ids") or []
    if isinstance(stop_ids, list) and len(stop_ids) > max_stop_token_ids:
        raise bad_request(
            f"stop_token_ids holds {len(stop_ids)} ids, more than {max_stop_token_ids}",
            "stop_token_ids",
        )
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=_integer(body, "top_k", 0) or 0,
            seed=_integer(body, "seed", None),
            max_tokens=max_tokens,
            stop_token_ids=_token_ids(stop_ids, "stop_token_ids", vocab_size),
            ignore_eos=_flag(body, "ignore_eos", False),
        )
    except InvalidRequestError as error:
        param = error.param if error.param != "max_tokens" else max_tokens_field
        raise bad_request(str(error), param) from None


def _conversation(body: Mapping[str, Any], max_messages: int) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if len(messages) > max_messages:
        raise bad_request(
            f"messages holds {len(messages)} messages, more than {max_messages}", "messages"
        )
    conversation = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where)
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant"):
            raise bad_request(f"{where}.role must be system, user or assistant", f"{where}.role")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad_request(f"{where}.content: only text parts", f"{where}.content")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string", f"{where}.content")
        conversation.append({"role": role, "content": content})
    return conversation


def _chat_prompt(conversation: list[dict[str, str]], tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)


def _completion_prompt(
    body: Mapping[str, Any], tokenizer: Tokenizer, vocab_size: int
) -> tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tuple(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return _token_ids(prompt, "prompt", vocab_size)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return tuple(tokenizer.encode(prompt[0], add_special_tokens=True))
    raise bad_request("prompt must be a string or a list of token ids (one prompt)", "prompt")


def parse_generation(
    body: Any,
    *,
    chat: bool,
    tokenizer: Tokenizer,
    model_name: str,
    vocab_size: int,
    max_context: int,
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS,
    max_messages: int = MAX_MESSAGES,
    slo_classes: Collection[str] = SLO_CLASSES,
) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("model is required", "model")
    if model != model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(body)
    max_tokens_field = "max_completion_tokens" if chat else "max_tokens"
    sampling = _sampling(body, max_tokens_field, vocab_size, max_stop_token_ids)
    conversation = _conversation(body, max_messages) if chat else None
    prompt_ids = (
        _chat_prompt(conversation, tokenizer)
        if conversation is not None
        else _completion_prompt(body, tokenizer, vocab_size)
    )
    if not prompt_ids:
        raise bad_request("the prompt is empty", "messages" if chat else "prompt")
    if len(prompt_ids) + sampling.max_tokens > max_context:
        raise APIError(
            400,
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({sampling.max_tokens}) exceeds "
            f"the context of {max_context} tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    extension = body.get("augury") or {}
    if not isinstance(extension, dict):
        raise bad_request("augury must be an object", "augury")
    slo = extension.get("tpot_slo_ms")
    if slo is not None and (
        isinstance(slo, bool)
        or not isinstance(slo, int | float)
        or not 0 < slo < math.inf  # NaN fails too
    ):
        raise bad_request("augury.tpot_slo_ms must be a positive number", "augury.tpot_slo_ms")
    slo_class = _slo_class(extension, slo_classes)
    draft = extension.get("draft_model")
    if draft is not None and not isinstance(draft, str):
        raise bad_request("augury.draft_model must be a string", "augury.draft_model")
    if draft is not None and not 0 < len(draft) <= MAX_DRAFT_NAME_LEN:
        raise bad_request(
            f"augury.draft_model must be 1 to {MAX_DRAFT_NAME_LEN} characters",
            "augury.draft_model",
        )
    app = extension.get("app")
    if app is not None and (not isinstance(app, str) or not 0 < len(app) <= MAX_APP_LEN):
        raise bad_request(
            f"augury.app must be a string of 1 to {MAX_APP_LEN} characters", "augury.app"
        )
    priority = _integer(body, "priority", 0) or 0
    if abs(priority) > MAX_PRIORITY:
        raise bad_request("priority is out of range", "priority")
    return GenerationRequest(
        chat=chat,
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=_flag(body, "stream", False),
        include_usage=_flag(options, "include_usage", False),
        priority=priority,
        tpot_slo_ms=None if slo is None else float(slo),
        draft_model=draft,
        speculate=_flag(extension, "speculate", True),
        continuous_usage=_flag(options, "continuous_usage_stats", False),
        messages=_turns(conversation),
        prompt_text=None if chat else _prompt_text(body.get("prompt")),
        slo_class=slo_class,
        app=app or "",
    )


def _slo_class(extension: Mapping[str, Any], known: Collection[str]) -> str | None:
    name = extension.get("slo_class")
    if name is None:
        return None
    if not isinstance(name, str):
        raise bad_request("augury.slo_class must be a string", "augury.slo_class")
    if name not in known:
        raise bad_request(
            f"unknown SLO class {name[:64]!r}; known: {', '.join(sorted(known))}",
            "augury.slo_class",
        )
    return name


def _turns(conversation: list[dict[str, str]] | None) -> tuple[tuple[str, str], ...] | None:
    if conversation is None:
        return None
    return tuple((m["role"], m["content"]) for m in conversation)


def _prompt_text(prompt: Any) -> str | None:
    """A completion prompt's text (None for token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None
