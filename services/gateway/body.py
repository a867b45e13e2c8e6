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
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from services.gateway.body_fields import (
    AuguryFields,
    ChatLogprobs,
    ChoicesFields,
    CompletionLogprobs,
    EchoField,
    MaxTokensFields,
    PriorityField,
    PromptLogprobs,
    SamplingFields,
    ServingFlags,
    token_ids_problem,
)
from services.gateway.errors import APIError, bad_request
from services.gateway.messages import parse_conversation, turns_for_recording
from services.gateway.structured import parse_structured
from services.gateway.tools import Tools, call_constraint, parse_tools
from shared.errors import InvalidRequestError, UnsupportedOptionError
from shared.settings import SloSettings
from shared.text.chat_template import render_chat, template_features
from shared.values.sampling import SamplingParams, StructuredOutput, refuse_unsupported
from shared.wire.requests import MAX_APP_LEN, MAX_DRAFT_NAME_LEN

__all__ = ["APIError", "GenerationRequest", "Tokenizer", "bad_request", "parse_generation"]

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


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    try:
        # the engine's list (one list for both), less what the gateway serves itself
        refuse_unsupported({k: v for k, v in body.items() if k not in GATEWAY_OPTIONS})
    except UnsupportedOptionError as error:
        raise bad_request(str(error), error.param) from None


def _logprobs(body: Mapping[str, Any], chat: bool) -> dict[str, int | None]:
    """SamplingParams' logprobs options. Chat asks with `logprobs: true` and `top_logprobs: N`;
    completions with `logprobs: N` (0: the emitted tokens' own)."""
    model = ChatLogprobs if chat else CompletionLogprobs
    logprobs = model.read(body).count()
    prompt = PromptLogprobs.read(body).prompt_logprobs
    if prompt is None and not chat and EchoField.read(body).echo:
        prompt = logprobs  # echo shows the prompt's tokens with the output's
    return {"logprobs": logprobs, "prompt_logprobs": prompt}


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
    fields = dict(SamplingFields.read(body, vocab_size=vocab_size))
    try:
        return SamplingParams(max_tokens=max_tokens, **fields, **_logprobs(body, chat))
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
        return _prompt_token_ids(prompt, vocab_size)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return tuple(tokenizer.encode(prompt[0], add_special_tokens=True))
    raise bad_request("prompt must be a string or a list of token ids (one prompt)", "prompt")


def _prompt_token_ids(prompt: list[Any], vocab_size: int) -> tuple[int, ...]:
    problem = token_ids_problem(prompt, "prompt", vocab_size)
    if problem is not None:
        raise bad_request(problem, "prompt")
    return tuple(prompt)


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
    tokenizer's chat template). Fields are checked in a fixed order; the first failure is the
    400 (or 404) answered."""
    body = _served_body(body, model_name, chat)
    n = ChoicesFields.read(body, max_n=max_n).checked()
    stop = _stop_strings(body)
    echo = False if chat else EchoField.read(body).echo
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
    max_tokens_field = "max_completion_tokens" if chat else "max_tokens"
    max_tokens = _max_tokens(
        body, max_tokens_field, len(prompt_ids), max_context, default_max_tokens, chat=chat
    )
    echo_only = echo and max_tokens == 0  # one token is generated (the prefill's) and dropped
    sampling = _sampling(
        body, max_tokens_field, vocab_size, max_stop_token_ids, 1 if echo_only else max_tokens, chat
    )
    if structured is not None:
        sampling = dataclasses.replace(sampling, structured=structured[0])
    _check_context(len(prompt_ids), sampling.max_tokens, max_context, chat)
    return GenerationRequest(
        **_serving_options(body, slo_classes),
        chat=chat,
        prompt_ids=prompt_ids,
        sampling=sampling,
        messages=None if conversation is None else turns_for_recording(conversation),
        prompt_text=None if chat else _prompt_text(body.get("prompt")),
        stop=stop,
        n=n,
        echo=echo,
        echo_only=echo_only,
        tools=tools if tools is not None and tools.in_prompt else None,
        call_format=call_format,
        structured_field=None if structured is None else structured[1],
    )


def _served_body(body: Any, model_name: str, chat: bool) -> dict[str, Any]:
    """The body, when it is an object naming the served model and no option refused by name."""
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
    return body


def _check_context(prompt_len: int, max_tokens: int, max_context: int, chat: bool) -> None:
    if prompt_len + max_tokens > max_context:
        raise APIError(
            400,
            f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"the context of {max_context} tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )


def _serving_options(body: Mapping[str, Any], slo_classes: Collection[str]) -> dict[str, Any]:
    """How the request is served: streaming, the `augury` extension, its priority."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    extension = body.get("augury") or {}
    if not isinstance(extension, dict):
        raise bad_request("augury must be an object", "augury")
    _refuse_unknown_augury_fields(extension)
    augury = AuguryFields.read(
        extension,
        slo_classes=slo_classes,
        max_draft_name_len=MAX_DRAFT_NAME_LEN,
        max_app_len=MAX_APP_LEN,
    )
    priority = PriorityField.read(body).priority
    flags = ServingFlags.gather(body, options, extension)
    return dict(
        stream=flags.stream,
        include_usage=flags.include_usage,
        priority=priority,
        tpot_slo_ms=augury.tpot_slo_ms,
        draft_model=augury.draft_model,
        speculate=flags.speculate,
        continuous_usage=flags.continuous_usage_stats,
        slo_class=augury.slo_class,
        app=augury.app,
        include_stop_str_in_output=flags.include_stop_str_in_output,
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
    max_tokens = getattr(MaxTokensFields.read({field: body.get(field)}), field)
    if max_tokens is None:
        max_tokens = MaxTokensFields.read({"max_tokens": body.get("max_tokens")}).max_tokens
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
