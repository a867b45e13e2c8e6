"""A conversation, with tools, tool calls and tool results, as prompt ids through the model's
chat template.

A template that reads `tools` (Qwen2.5's, Llama 3.1's) gets them as `tools=` and renders them
itself; one that reads `tool_calls` renders assistant calls (arguments as objects) and `tool`
messages itself. A template that does neither (SmolLM2's) gets them rendered as plain turns:
the tools as a section of the system message (`tools_system_text`), each assistant call as
its text in the call format, each tool result as a user turn `<tool_response>\\n...\\n
</tool_response>`.

The call format (`shared.text.tool_calls`) is read from the template: `<tool_call>` means
hermes, `<|python_tag|>` or an `ipython` role means llama3_json; otherwise hermes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from shared.text.tool_calls import HERMES, LLAMA3_JSON

Message = dict[str, Any]


@dataclass(frozen=True)
class TemplateFeatures:
    reads_tools: bool  # the template renders `tools` itself
    reads_tool_calls: bool  # ... and assistant `tool_calls` and `tool` messages
    call_format: str


def template_features(tokenizer: Any) -> TemplateFeatures:
    template = getattr(tokenizer, "chat_template", None)
    return _features(template if isinstance(template, str) else "")


@functools.lru_cache(maxsize=8)
def _features(template: str) -> TemplateFeatures:
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        names = set()
    llama3 = "<|python_tag|>" in template or "ipython" in template
    return TemplateFeatures(
        reads_tools="tools" in names,
        reads_tool_calls="tool_calls" in template,
        call_format=LLAMA3_JSON if llama3 and "<tool_call>" not in template else HERMES,
    )


def call_text(name: str, arguments: Mapping[str, Any], call_format: str) -> str:
    """One call as the model writes it."""
    if call_format == LLAMA3_JSON:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def tools_system_text(tools: Sequence[Mapping[str, Any]], call_format: str) -> str:
    """The tools as a system-message section, for templates that do not render them."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    if call_format == LLAMA3_JSON:
        how = (
            'To call a function, answer with only a JSON object {"name": <function name>, '
            '"parameters": <arguments as a JSON object>}; several calls are separated by "; ".'
        )
    else:
        how = (
            "To call a function, answer with a JSON object holding its name and arguments "
            "between <tool_call> and </tool_call> tags, one pair of tags per call:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
            "</tool_call>"
        )
    return (
        "# Tools\n\nYou can call functions to answer the user. They are described here, one "
        f"JSON object each, between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\n\n{how}"
    )


def _plain_turns(
    conversation: Sequence[Message], tools: Sequence[Mapping[str, Any]], call_format: str
) -> list[Message]:
    """The conversation as system, user and assistant turns of text alone."""
    turns: list[Message] = []
    for message in conversation:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            turns.append({"role": "user", "content": text})
        elif role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            sep = "; " if call_format == LLAMA3_JSON else "\n"
            text = sep.join(call_text(c["name"], c["arguments"], call_format) for c in calls)
            turns.append({"role": role, "content": f"{content}\n{text}" if content else text})
        else:
            turns.append({"role": role, "content": content})
    if tools:
        section = tools_system_text(tools, call_format)
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{section}"}
        else:
            turns.insert(0, {"role": "system", "content": section})
    return turns


def _template_turns(conversation: Sequence[Message]) -> list[Message]:
    """The conversation as templates that read tool calls take it (HF's convention)."""
    turns: list[Message] = []
    for message in conversation:
        turn = {k: v for k, v in message.items() if k != "tool_calls"}
        if message.get("tool_calls"):
            turn["content"] = message.get("content") or ""
            turn["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in message["tool_calls"]
            ]
        turns.append(turn)
    return turns


def render_chat(
    tokenizer: Any,
    conversation: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] = (),
    call_format: str | None = None,
) -> tuple[int, ...]:
    """The prompt's ids, ending with the assistant's turn opened.

    Messages are {"role", "content"}; an assistant's may hold `tool_calls`: [{"id", "name",
    "arguments": dict}], a tool's `tool_call_id`. `tools` are OpenAI's tool objects."""
    features = template_features(tokenizer)
    call_format = call_format or features.call_format
    has_calls = any(m["role"] == "tool" or m.get("tool_calls") for m in conversation)
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
    native = (not tools or features.reads_tools) and (not has_calls or features.reads_tool_calls)
    if native:
        turns = _template_turns(conversation)
        if tools:
            kwargs["tools"] = list(tools)
    else:
        turns = _plain_turns(conversation, tools, call_format)
    ids = tokenizer.apply_chat_template(turns, **kwargs)
    if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)
