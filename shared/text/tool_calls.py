"""Tool calls in a model's output text, in the format of its chat template, as the text arrives.

Two formats:

- `hermes` (Qwen2.5, and the rendering used for templates without tools): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; text outside the tags is
  content.
- `llama3_json` (Llama 3.1/3.2): the whole output is one call `{"name": ..., "parameters":
  {...}}` (`arguments` is read too), or several separated by `;`; an output that does not
  start with `{` is content.

`ToolCallParser` turns text deltas into content deltas and whole calls. A call is released once
it is complete and parses (its id and name, then its arguments), so what a stream shows equals
what a non-streamed answer shows; a call that never completes or does not parse is released as
content at the end. Whitespace-only content next to calls is dropped, so an output of calls
alone has no content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
TOOL_CALL_FORMATS = (HERMES, LLAMA3_JSON)
OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedText:
    """What one piece of output text made: content, and calls completed in it."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(text: str) -> ToolCall | None:
    """One call from its JSON text (None when it is not a call)."""
    try:
        call = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict) or not call["name"]:
        return None
    return ToolCall(new_call_id(), call["name"], json.dumps(arguments, ensure_ascii=False))


def _split_json_values(text: str) -> list[str] | None:
    """`text` as JSON objects separated by `;` (and whitespace); None when it is not."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (values and text[at] == ";")):
            at += 1
        if at == len(text):
            return values or None
        if text[at] != "{":
            return None
        try:
            _, end = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return None
        values.append(text[at:end])
        at = end


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallParser:
    """One choice's output, split into content and tool calls as it arrives."""

    format: str = HERMES
    calls: list[ToolCall] = field(default_factory=list)  # every call released so far
    _buffer: str = ""  # text not released yet: a possible tag, or a call being written
    _in_call: bool = False  # hermes: inside <tool_call>
    _whitespace: str = ""  # content whitespace held until more content shows it is content
    _mode: str = "undecided"  # llama3_json: "undecided", "calls" (buffer all) or "content"

    def __post_init__(self) -> None:
        if self.format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool-call format must be one of {TOOL_CALL_FORMATS}")

    def push(self, text: str) -> ParsedText:
        if self.format == LLAMA3_JSON:
            return self._push_llama3(text)
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG) :]
                self._in_call = False
                call = read_call(body)
                if call is None:  # not a call after all: its text is content
                    content += self._content(OPEN_TAG + body + CLOSE_TAG)
                else:
                    content += self._call(call, calls)
                continue
            start = self._buffer.find(OPEN_TAG)
            if start < 0:
                held = _held_prefix(self._buffer, OPEN_TAG)
                cut = len(self._buffer) - held
                content += self._content(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                break
            content += self._content(self._buffer[:start])
            self._buffer = self._buffer[start + len(OPEN_TAG) :]
            self._in_call = True
        return ParsedText(content, tuple(calls))

    def finish(self) -> ParsedText:
        """The rest at the end of the output: an unfinished call is content."""
        if self.format == LLAMA3_JSON:
            return self._finish_llama3()
        rest = (OPEN_TAG if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        content = self._content(rest)
        self._whitespace = ""
        return ParsedText(content)

    # ---- helpers -------------------------------------------------------------------------------
    def _content(self, text: str) -> str:
        """Content to release now: held whitespace goes out only before more content."""
        if not text:
            return ""
        text = self._whitespace + text
        body = text.rstrip()
        self._whitespace = text[len(body) :]
        return body

    def _call(self, call: ToolCall, calls: list[ToolCall]) -> str:
        self._whitespace = ""  # whitespace between content and a call is not content
        self.calls.append(call)
        calls.append(call)
        return ""

    def _push_llama3(self, text: str) -> ParsedText:
        if self._mode == "content":
            return ParsedText(self._content(text))
        self._buffer += text
        if self._mode == "undecided":
            stripped = self._buffer.lstrip()
            if not stripped:
                return ParsedText()
            self._mode = "calls" if stripped.startswith("{") else "content"
            if self._mode == "content":
                rest, self._buffer = self._buffer, ""
                return ParsedText(self._content(rest.lstrip()))
        return ParsedText()

    def _finish_llama3(self) -> ParsedText:
        text, self._buffer = self._buffer, ""
        self._whitespace = ""
        if self._mode != "calls":
            return ParsedText()
        pieces = _split_json_values(text)
        calls = [read_call(piece) for piece in pieces or []]
        if not calls or any(call is None for call in calls):
            return ParsedText(text.strip())
        found = [call for call in calls if call is not None]
        self.calls.extend(found)
        return ParsedText("", tuple(found))


def parse_tool_calls(text: str, format: str = HERMES) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when there is none) and tool calls."""
    parser = ToolCallParser(format)
    first, last = parser.push(text), parser.finish()
    content = first.content + last.content
    return content or None, [*first.calls, *last.calls]
