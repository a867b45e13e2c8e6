"""A chat answer's tool calls in OpenAI's format: the message of a whole answer, and the deltas
of a stream (each call: its index, id, type and name with empty arguments first, then its
arguments), from `shared.text.tool_calls`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shared.text.tool_calls import ParsedText, ToolCall, ToolCallParser, parse_tool_calls


def finish_reason(finish: str | None, has_calls: bool) -> str | None:
    """OpenAI's `tool_calls` for an output that ended by itself with calls in it."""
    return "tool_calls" if finish == "stop" and has_calls else finish


def tool_message(text: str, call_format: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole output, and whether it holds calls."""
    content, calls = parse_tool_calls(text, call_format)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message, bool(calls)


def stream_deltas(parser: ToolCallParser, pieces: Iterable[ParsedText]) -> list[dict[str, Any]]:
    """The `delta` objects of parsed output pieces, in order (none for held-back text)."""
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        if piece.content:
            deltas.append({"content": piece.content})
        for call in piece.calls:
            deltas.extend(_call_deltas(_index(parser, call), call))
    return deltas


def _index(parser: ToolCallParser, call: ToolCall) -> int:
    return next(i for i, known in enumerate(parser.calls) if known.id == call.id)


def _call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    opening = {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
    arguments = {"index": index, "function": {"arguments": call.arguments}}
    return [{"tool_calls": [opening]}, {"tool_calls": [arguments]}]
