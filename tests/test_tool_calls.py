"""Tool calls without a model: parsing both formats (whole and streamed), rendering through chat
templates, and the grammar of a forced call walked token by token with llguidance."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from services.gateway.errors import APIError
from services.gateway.tool_output import stream_deltas, tool_message
from services.gateway.tools import call_constraint, parse_tools
from shared.grammar.spec import grammar_text
from shared.model.smollm2 import ensure_smollm2
from shared.text.chat_template import render_chat, template_features
from shared.text.tool_calls import HERMES, LLAMA3_JSON, ToolCallParser, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
HERMES_TEXT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2]}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2())


# ---- parsing -----------------------------------------------------------------------------------
def test_hermes_calls_and_content_are_split() -> None:
    content, calls = parse_tool_calls(HERMES_TEXT, HERMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("add", {"a": 1, "b": [2]}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_calls_alone_have_no_content_and_text_alone_no_calls() -> None:
    only_calls = HERMES_TEXT.removeprefix("Let me look.")
    assert parse_tool_calls("\n" + only_calls + "\n", HERMES)[0] is None
    assert parse_tool_calls("The answer is 4 < 5.", HERMES) == ("The answer is 4 < 5.", [])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",  # not JSON: the text is content
        '<tool_call>\n{"name": "add", "arguments": {"a": 1',  # cut off (max_tokens)
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    ],
)
def test_broken_hermes_calls_are_content(text: str) -> None:
    assert parse_tool_calls(text, HERMES) == (text, [])


def test_llama3_json_calls() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}'
    content, calls = parse_tool_calls(one, LLAMA3_JSON)
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo", "unit": "f"}')
    ]
    two = one + '; {"name": "add", "arguments": {"a": 1, "b": []}}'
    assert [c.name for c in parse_tool_calls(two, LLAMA3_JSON)[1]] == ["get_weather", "add"]
    assert parse_tool_calls("Oslo is cold.", LLAMA3_JSON) == ("Oslo is cold.", [])
    assert parse_tool_calls("{ not a call", LLAMA3_JSON) == ("{ not a call", [])


FORCED_HERMES = HERMES_TEXT.removeprefix("Let me look.\n")
FORCED_LLAMA3 = (
    '{"name": "get_weather", "parameters": {"city": "a \\"}{\\" b", "unit": "c"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": [2, {"c": []}]}}'
)


def assembled(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool calls put together by index, as clients do."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"name": None, "arguments": "", "id": None})
            if "id" in piece:
                assert call["id"] is None and piece["type"] == "function"  # opened once
                assert piece["function"]["arguments"] == ""
                call["id"], call["name"] = piece["id"], piece["function"]["name"]
            else:
                assert call["id"] is not None  # name and id first
                call["arguments"] += piece["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    ("text", "call_format", "incremental"),
    [
        (HERMES_TEXT, HERMES, False),
        ("a <tool_ca b <tool_call>\n{]\n</tool_call> c", HERMES, False),
        ('{"name": "add", "parameters": {"a": 1, "b": []}}', LLAMA3_JSON, False),
        (FORCED_HERMES, HERMES, True),
        (FORCED_HERMES.removesuffix("</tool_call>")[:-9], HERMES, True),  # cut off
        (FORCED_LLAMA3, LLAMA3_JSON, True),
    ],
)
def test_streamed_pieces_make_the_whole_answer(
    text: str, call_format: str, incremental: bool
) -> None:
    """Any split of the text into deltas gives the non-streamed answer's content and calls."""
    whole_content, whole_calls = parse_tool_calls(text, call_format, incremental=incremental)
    rng = random.Random(7)
    for _ in range(40):
        parser = ToolCallParser(call_format, incremental)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        deltas = stream_deltas([parser.push(piece) for piece in pieces] + [parser.finish()])
        content = "".join(d.get("content", "") for d in deltas)
        assert (content or None) == whole_content
        calls = assembled(deltas)
        assert [(c["id"], c["name"], c["arguments"]) for c in calls] == [
            (c.id, c.name, c.arguments) for c in parser.calls
        ]
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in whole_calls
        ]
    if incremental and text == FORCED_LLAMA3:
        arguments = [json.loads(c.arguments) for c in whole_calls]
        assert arguments == [{"city": 'a "}{" b', "unit": "c"}, {"a": 1, "b": [2, {"c": []}]}]


def test_forced_arguments_stream_as_they_are_written() -> None:
    parser = ToolCallParser(HERMES, incremental=True)
    first = parser.push('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert [type(e).__name__ for e in first.events] == ["CallOpened", "Arguments"]
    assert stream_deltas([first])[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1'
    rest = parser.push(', "b": []}}\n</tool_call>')
    assert stream_deltas([rest]) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "b": []}'}}]}
    ]
    assert parser.finish().events == () and parser.calls[0].arguments == '{"a": 1, "b": []}'


def test_tool_message_is_openais() -> None:
    message, called = tool_message(FORCED_HERMES, HERMES, incremental=False)
    assert called and message["content"] is None and message["role"] == "assistant"
    assert [m["function"]["name"] for m in message["tool_calls"]] == ["get_weather", "add"]
    assert all(m["type"] == "function" for m in message["tool_calls"])


# ---- request fields ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_tools(body, chat=True)
    assert caught.value.status == 400 and caught.value.param == param


def test_tools_are_for_chat() -> None:
    with pytest.raises(APIError, match="chat completions"):
        parse_tools({"tools": [WEATHER]}, chat=False)
    assert parse_tools({"tools": [], "tool_choice": "none"}, chat=True) is None


# ---- rendering ---------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}],
    },
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
]
# a template of our own that reads tools and tool calls (as Qwen2.5's and Llama 3.1's do)
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}:{{ c.function.arguments | tojson }}]"
    "{% endfor %}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_without_tools_gets_them_as_plain_turns(smollm2_tokenizer: Any) -> None:
    assert not template_features(smollm2_tokenizer).reads_tools
    text = smollm2_tokenizer.decode(list(render_chat(smollm2_tokenizer, CONVERSATION, [WEATHER])))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_with_tools_renders_them_itself(smollm2_tokenizer: Any) -> None:
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    features = template_features(tokenizer)
    assert features.reads_tools and features.reads_tool_calls and features.call_format == HERMES
    text = tokenizer.decode(list(render_chat(tokenizer, CONVERSATION, [WEATHER])))
    assert text == (
        "<tools>get_weather;</tools><user>Weather in Paris?</user>"
        '<assistant>[get_weather:{"city": "Paris"}]</assistant>'
        '<tool>{"temp": 21}</tool><assistant>'
    )


def test_plain_chats_render_as_before(smollm2_tokenizer: Any) -> None:
    turns = [{"role": "user", "content": "Hi"}]
    expected = smollm2_tokenizer.apply_chat_template(
        turns, add_generation_prompt=True, return_dict=False
    )
    assert list(render_chat(smollm2_tokenizer, turns)) == list(expected)


# ---- the grammar of a forced call, walked with random allowed tokens -----------------------------
@pytest.fixture(scope="module")
def ll_tokenizer(smollm2_tokenizer: Any) -> Any:
    return llguidance.hf.from_tokenizer(smollm2_tokenizer)


def random_walk(
    tokenizer: Any, ll_tokenizer: Any, grammar: str, seed: int, limit: int = 300
) -> str:
    """A text the grammar accepts, made of random allowed tokens (ending where it may end)."""
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    mask = allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    rng, tokens = random.Random(seed), []
    for _ in range(limit):
        if matcher.is_stopped() or (matcher.is_accepting() and rng.random() < 0.5):
            break
        fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: ll_tokenizer.vocab_size]
        allowed = [t for t in np.flatnonzero(bits) if t != tokenizer.eos_token_id]
        token = int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    assert matcher.is_accepting(), "the walk did not end within the limit"
    return str(tokenizer.decode(tokens))


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "call_format"),
    [
        ("required", True, HERMES),
        ({"type": "function", "function": {"name": "add"}}, True, HERMES),
        ("required", False, LLAMA3_JSON),
    ],
)
def test_forced_calls_parse_and_validate(
    smollm2_tokenizer: Any, ll_tokenizer: Any, tool_choice: Any, parallel: bool, call_format: str
) -> None:
    body = {"tools": [WEATHER, ADD], "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    tools = parse_tools(body, chat=True)
    assert tools is not None
    grammar = grammar_text(call_constraint(tools, call_format))
    counts = set()
    for seed in range(2):
        text = random_walk(smollm2_tokenizer, ll_tokenizer, grammar, seed)
        content, calls = parse_tool_calls(text, call_format, incremental=True)
        assert content is None and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if isinstance(tool_choice, dict):
            assert [c.name for c in calls] == ["add"]
        counts.add(len(calls))
    assert counts == {1} if not parallel or isinstance(tool_choice, dict) else max(counts) > 1


def test_a_llama3_style_template_means_json_calls(smollm2_tokenizer: Any) -> None:
    tokenizer = copy.copy(smollm2_tokenizer)
    # reads neither tools nor tool calls, but names the ipython role as Llama 3.1's does
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{# ipython #}"
    )
    assert template_features(tokenizer).call_format == LLAMA3_JSON
    text = tokenizer.decode(list(render_chat(tokenizer, CONVERSATION, [WEATHER])))
    assert text.startswith("<system># Tools") and '"parameters": <arguments' in text
    assert '<assistant>{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
