"""A chat answer's tool calls in OpenAI's format: the message of a whole answer, and the deltas
of a stream (each call: its index, id, type and name with empty arguments first, then pieces of
its arguments), from `shared.text.tool_calls`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shared.text.tool_calls import CallOpened, Content, ParsedText, parse_tool_calls


def finish_reason(finish: str | None, has_calls: bool) -> str | None:
    """OpenAI's `tool_calls` for an output that ended by itself with calls in it."""
    return "tool_calls" if finish == "stop" and has_calls else finish


def tool_message(text: str, call_format: str, incremental: bool) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole output, and whether it holds calls."""
    content, calls = parse_tool_calls(text, call_format, incremental=incremental)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message, bool(calls)


def stream_deltas(pieces: Iterable[ParsedText]) -> list[dict[str, Any]]:
    """The `delta` objects of parsed output pieces, in order (none for held-back text)."""
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        for event in piece.events:
            if isinstance(event, Content):
                deltas.append({"content": event.text})
            elif isinstance(event, CallOpened):
                opening = {
                    "index": event.index,
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
                deltas.append({"tool_calls": [opening]})
            else:
                arguments = {"index": event.index, "function": {"arguments": event.text}}
                deltas.append({"tool_calls": [arguments]})
    return deltas
