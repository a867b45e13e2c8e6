"""Chat messages as clients send them: text turns, assistant turns with `tool_calls`, and `tool`
results, checked and put in the shape `shared.text.chat_template.render_chat` takes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from services.gateway.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_conversation(body: Mapping[str, Any], max_messages: int) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if len(messages) > max_messages:
        raise bad_request(
            f"messages holds {len(messages)} messages, more than {max_messages}", "messages"
        )
    return [_message(message, f"messages[{index}]") for index, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", where)
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
    if role == "developer":  # OpenAI's newer name for the system turn
        role = "system"
    calls = message.get("tool_calls") if role == "assistant" else None
    content = _content(message.get("content"), where, optional=bool(calls))
    turn: dict[str, Any] = {"role": role, "content": content}
    if calls:
        turn["tool_calls"] = _calls(calls, f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        turn["tool_call_id"] = call_id
    return turn


def _content(content: Any, where: str, *, optional: bool) -> str:
    if content is None and optional:
        return ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise bad_request(f"{where}.content: only text parts", f"{where}.content")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string", f"{where}.content")
    return content


def _calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls: ids, names, and arguments read from their JSON text."""
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", where)
    parsed = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{at} must hold function.name", f"{at}.function")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise bad_request(
                f"{at}.function.arguments must be a JSON object (as text)",
                f"{at}.function.arguments",
            )
        call_id = call.get("id")
        parsed.append(
            {
                "id": call_id if isinstance(call_id, str) else f"call_{index}",
                "name": function["name"],
                "arguments": arguments,
            }
        )
    return parsed


def turns_for_recording(conversation: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """(role, text) of each message; an assistant's calls as their JSON after its text."""
    turns = []
    for message in conversation:
        text = message["content"]
        for call in message.get("tool_calls", ()):
            text += json.dumps({"name": call["name"], "arguments": call["arguments"]})
        turns.append((message["role"], text))
    return tuple(turns)
