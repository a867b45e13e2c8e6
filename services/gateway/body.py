"""Request bodies of the OpenAI-compatible endpoints: validation and tokenization.

Besides OpenAI's fields we take vLLM's `top_k` (-1 or 0: off), `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output` and `priority` (lower runs sooner), and our own extension object:

    "augury": {"slo_class": "standard", "tpot_slo_ms": 50, "draft_model": "tiny",
               "speculate": true, "app": "code-review"}

`slo_class` names one of `scheduler.slo.classes`: its time-per-output-token objective is that
class's multiple of the machine's baseline latency (shared/scheduling/slo_classes.py).
`tpot_slo_ms` gives the objective in ms and wins over the class's (the class still names the
request's class in metrics); with neither, `scheduler.slo.default_class` applies (none: best
effort). `draft_model` picks one configured draft model (none: the scheduler chooses), and
`speculate: false` turns speculation off for the request. `app` names the request's application
(1 to 128 characters): a model-free `suffix` draft shares its cache of recent sequences only
among the requests that name the same one. Any other field in it is a 400.

Without `max_tokens` (`max_completion_tokens`) a request may run to the end of the context, as in
vLLM (`gateway.default_max_tokens` may lower that). `stop` strings (at most MAX_STOP_STRINGS)
are matched on the detokenized text by the gateway (shared/text/stop_strings.py). `n` > 1 fans
out into n requests (see choices.py); `echo` (completions) puts the prompt's text first, and with
`logprobs` the prompt's tokens' log-probabilities first (`max_tokens: 0` with `echo`: the prompt
alone, as vLLM answers). vLLM's `prompt_logprobs: N` (chat and completions) asks for them alone.
vLLM's extension fields that Augury does not implement are refused by name (VLLM_UNIMPLEMENTED).

`response_format` and vLLM's `guided_*` fields constrain the output (structured.py); chat's
`tools`, `tool_choice` and `parallel_tool_calls` are in tools.py, and messages with tool calls
and tool results in messages.py (docs/structured-output-api.md).

The final chunk of a stream (and a non-streamed answer) carries `augury`: the request's
speculation statistics, and `slo_class`, `tpot_slo_ms` (resolved), `tpot_ms` (measured by the
scheduler) and `slo_met` (null without an objective or with fewer than 2 tokens).

In streams, vLLM's `stream_options: {"continuous_usage_stats": true}` puts `usage` (prompt,
completion so far, total) on every chunk; `include_usage` adds the final usage-only chunk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from services.gateway.errors import APIError, bad_request
from services.gateway.messages import parse_conversation, turns_for_recording
from services.gateway.structured import parse_structured
from services.gateway.tools import Tools, call_constraint, parse_tools
from shared.errors import InvalidRequestError, UnsupportedOptionError
from shared.settings import SloSettings
from shared.text.chat_template import render_chat, template_features
from shared.values.sampling import (
    MAX_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutput,
    refuse_unsupported,
)
from shared.wire.requests import MAX_APP_LEN, MAX_DRAFT_NAME_LEN

__all__ = ["APIError", "GenerationRequest", "Tokenizer", "bad_request", "parse_generation"]

MAX_PRIORITY = 2**31 - 1
MAX_STOP_TOKEN_IDS = 64  # default of gateway.max_stop_token_ids
MAX_MESSAGES = 256  # default of gateway.max_messages
SLO_CLASSES = tuple(SloSettings().classes)  # default of scheduler.slo.classes
MAX_N = 16  # default of gateway.max_n
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_STRING_CHARS = 256
AUGURY_FIELDS = frozenset({"slo_class", "tpot_slo_ms", "draft_model", "speculate", "app"})
# Options the engine's list refuses that the gateway serves itself: n (fan-out), best_of (= n),
# echo (completions), and tools and response_format (as `SamplingParams.structured`).
GATEWAY_OPTIONS = frozenset({"n", "best_of", "echo", "tools", "tool_choice", "response_format"})
# vLLM's extension fields that Augury does not implement, with the values that mean "off": any
# other value is refused by name, never ignored. (`min_tokens` and `prompt_logprobs` are built:
# shared/engine/processors.py, shared/engine/verifier.py.)
VLLM_UNIMPLEMENTED: dict[str, tuple[object, ...]] = {
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None,),
    "truncate_prompt_tokens": (None,),
    "length_penalty": (None, 1.0),
    "early_stopping": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "prompt_embeds": (None,),
}


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


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
    stop: tuple[str, ...] = ()  # stop strings, matched by the gateway on the text
    include_stop_str_in_output: bool = False
    n: int = 1  # completions of the prompt, each its own request to the scheduler
    echo: bool = False  # completions: the prompt's text before the output
    # completions' `echo` with `max_tokens: 0` (OpenAI's and vLLM's way to score a prompt): one
    # token is generated (the prefill's) and dropped; the answer holds the prompt alone
    echo_only: bool = False
    # chat: the tools offered, and the call format of the model's template (tool_calls.py)
    tools: Tools | None = None
    call_format: str = "hermes"
    # the field the output's constraint came from, named by a 400 when it does not compile
    structured_field: str | None = None


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
    try:
        # the engine's list (one list for both), less what the gateway serves itself
        refuse_unsupported({k: v for k, v in body.items() if k not in GATEWAY_OPTIONS})
    except UnsupportedOptionError as error:
        raise bad_request(str(error), error.param) from None


# ---- logits processors and logprobs (the engine's shared/engine/processors.py) ------------------


def _processors_and_logprobs(
    body: Mapping[str, Any], chat: bool, vocab_size: int
) -> dict[str, Any]:
    """SamplingParams' processor and logprobs options from the body, checked here where a 400
    must name the field as the client spelled it (the engine checks the ranges again).

    Chat asks for logprobs with `logprobs: true` and `top_logprobs: N`; completions with
    `logprobs: N` (0: the emitted tokens' own)."""
    options: dict[str, Any] = {
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "min_p": _number(body, "min_p", 0.0),
        "min_tokens": _integer(body, "min_tokens", 0) or 0,
        "logit_bias": _logit_bias(body.get("logit_bias"), vocab_size),
    }
    if chat:
        top = _integer(body, "top_logprobs", None)
        wanted = _flag(body, "logprobs", False)
        if top and not wanted:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        options["logprobs"] = (top or 0) if wanted else None
    else:
        number = _integer(body, "logprobs", None)
        if number is not None and not 0 <= number <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
        options["logprobs"] = number
    prompt = _integer(body, "prompt_logprobs", None)
    if prompt is not None and not 0 <= prompt <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
    if prompt is None and not chat and _flag(body, "echo", False):
        prompt = options["logprobs"]  # echo shows the prompt's tokens with the output's
    options["prompt_logprobs"] = prompt
    return options


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """OpenAI's map of token ids (JSON string keys) to biases in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("logit_bias must map token ids to biases", "logit_bias")
    bias = {}
    for key, amount in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < vocab_size):
            raise bad_request(
                f"logit_bias keys are token ids in [0, {vocab_size}), got {key[:32]!r}",
                "logit_bias",
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise bad_request("logit_bias values must be numbers", "logit_bias")
        if not -MAX_BIAS <= amount <= MAX_BIAS:  # NaN fails too
            raise bad_request(
                f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]", "logit_bias"
            )
        bias[int(key)] = float(amount)
    return bias


def _sampling(
    body: Mapping[str, Any],
    max_tokens_field: str,
    vocab_size: int,
    max_stop_token_ids: int,
    max_tokens: int,
    chat: bool = False,
) -> SamplingParams:
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
            top_k=_top_k(body),
            seed=_integer(body, "seed", None),
            max_tokens=max_tokens,
            stop_token_ids=_token_ids(stop_ids, "stop_token_ids", vocab_size),
            ignore_eos=_flag(body, "ignore_eos", False),
            **_processors_and_logprobs(body, chat, vocab_size),
        )
    except InvalidRequestError as error:
        param = error.param if error.param != "max_tokens" else max_tokens_field
        raise bad_request(str(error), param) from None


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
    default_max_tokens: int | None = None,
    max_n: int = MAX_N,
    call_format: str | None = None,
) -> GenerationRequest:
    """The request, checked and tokenized (its output constraint is compiled by the caller,
    `structured.check_compiles`). `call_format`: the tool-call format (None: the one of the
    tokenizer's chat template)."""
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
    _refuse_vllm_extensions(body, chat)
    n = _choices(body, max_n)
    stop = _stop_strings(body)
    echo = _echo(body, chat)
    max_tokens_field = "max_completion_tokens" if chat else "max_tokens"
    tools = parse_tools(body, chat)
    call_format = call_format or template_features(tokenizer).call_format
    structured = _constraint(body, tools, call_format)
    conversation = parse_conversation(body, max_messages) if chat else None
    if conversation is not None:
        offered = [f.openai() for f in tools.functions] if tools and tools.in_prompt else []
        prompt_ids = render_chat(tokenizer, conversation, offered, call_format)
    else:
        prompt_ids = _completion_prompt(body, tokenizer, vocab_size)
    if not prompt_ids:
        raise bad_request("the prompt is empty", "messages" if chat else "prompt")
    max_tokens = _max_tokens(
        body, max_tokens_field, len(prompt_ids), max_context, default_max_tokens, chat=chat
    )
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1
    sampling = _sampling(body, max_tokens_field, vocab_size, max_stop_token_ids, max_tokens, chat)
    if structured is not None:
        sampling = dataclasses.replace(sampling, structured=structured[0])
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
    _refuse_unknown_augury_fields(extension)
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
        messages=None if conversation is None else turns_for_recording(conversation),
        prompt_text=None if chat else _prompt_text(body.get("prompt")),
        slo_class=slo_class,
        app=app or "",
        stop=stop,
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
        n=n,
        echo=echo,
        echo_only=echo_only,
        tools=tools if tools is not None and tools.in_prompt else None,
        call_format=call_format,
        structured_field=None if structured is None else structured[1],
    )


def _constraint(
    body: Mapping[str, Any], tools: Tools | None, call_format: str
) -> tuple[StructuredOutput, str] | None:
    """The output's constraint and the field it came from: response_format (or vLLM's
    fields), or the grammar of a required or named tool call."""
    structured = parse_structured(body)
    if tools is None or not tools.forced:
        return structured
    if structured is not None:
        raise bad_request(
            f"{structured[1]} and a required tool call both constrain the output; send one",
            structured[1],
        )
    return call_constraint(tools, call_format), "tools"


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


def _prompt_text(prompt: Any) -> str | None:
    """A completion prompt's text (None for token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


# ---- what real clients send: stop strings, n, echo, defaults, vLLM's extensions ----------------
def _refuse_vllm_extensions(body: Mapping[str, Any], chat: bool) -> None:
    for name, neutral in VLLM_UNIMPLEMENTED.items():
        if name in body and body[name] not in neutral:
            raise bad_request(f"{name} is not supported by this server", name)
    if chat and body.get("echo") not in (None, False):
        raise bad_request("echo is for completions; chat completions do not echo", "echo")


def _refuse_unknown_augury_fields(extension: Mapping[str, Any]) -> None:
    unknown = sorted(str(name)[:64] for name in extension if name not in AUGURY_FIELDS)
    if unknown:
        raise bad_request(
            f"unknown field(s) in augury: {', '.join(unknown)}; known: "
            f"{', '.join(sorted(AUGURY_FIELDS))}",
            f"augury.{unknown[0]}",
        )


def _top_k(body: Mapping[str, Any]) -> int:
    """vLLM's top_k: -1 (and 0) mean no truncation."""
    top_k = _integer(body, "top_k", 0) or 0
    if top_k < -1:
        raise bad_request(f"top_k must be positive, or -1 or 0 for off; got {top_k}", "top_k")
    return 0 if top_k == -1 else top_k


def _max_tokens(
    body: Mapping[str, Any],
    field: str,
    prompt_len: int,
    max_context: int,
    default: int | None,
    *,
    chat: bool,
) -> int:
    """The request's max_tokens; without one, the rest of the context (as vLLM, for chat and
    completions alike), lowered to `gateway.default_max_tokens` when that is set."""
    max_tokens = _integer(body, field, None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None)
    if max_tokens is not None:
        return max_tokens
    rest = max_context - prompt_len
    if rest < 1:
        raise APIError(
            400,
            f"the prompt ({prompt_len} tokens) leaves no room in the context of {max_context} "
            "tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    return rest if default is None else min(rest, default)


def _stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None or stop == "" or stop == []:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop holds {len(stops)} strings, more than {MAX_STOP_STRINGS}", "stop")
    if not all(0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops):
        raise bad_request(
            f"each stop string must be 1 to {MAX_STOP_STRING_CHARS} characters", "stop"
        )
    return tuple(stops)


def _choices(body: Mapping[str, Any], max_n: int) -> int:
    """n, and best_of as far as it can be served without logprobs (best_of = n)."""
    n = _integer(body, "n", 1)
    assert n is not None
    if not 1 <= n <= max_n:
        raise bad_request(f"n must be 1 to {max_n}, got {n}", "n")
    best_of = _integer(body, "best_of", None)
    if best_of is not None and best_of < n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of is not None and best_of > n:
        raise bad_request(
            "best_of > n ranks candidates by their cumulative log-probability, which this "
            "server does not compute yet; send best_of equal to n, or leave it out",
            "best_of",
        )
    return n


def _echo(body: Mapping[str, Any], chat: bool) -> bool:
    return False if chat else _flag(body, "echo", False)
