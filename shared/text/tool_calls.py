"""Tool calls in a model's output text, in the format of its chat template, as the text arrives.

Two formats:

- `hermes` (Qwen2.5, and the rendering used for templates without tools): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; text outside the tags is
  content.
- `llama3_json` (Llama 3.1/3.2): the whole output is one call `{"name": ..., "parameters":
  {...}}` (`arguments` is read too), or several separated by `;`; an output that does not
  start with `{` is content.

`ToolCallParser` turns text deltas into events: content, a call opened (index, id, name) and
pieces of its arguments. A model writing freely (`tool_choice: auto`) has each call released
once it is complete and parses (arguments re-serialized), and a call that never completes or
does not parse is content; a forced call (`incremental`: the grammar guarantees its shape) is
opened once its name is written and its arguments (the model's own text) stream as they are
written. A whole answer is parsed the same way, so a stream shows what a non-streamed answer
shows. Whitespace-only content next to calls is dropped: an output of calls alone has no
content.
"""

from __future__ import annotations

import json
import re
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
class Content:
    text: str


@dataclass(frozen=True)
class CallOpened:
    """A call's start: its index in the choice, id and name (its arguments follow)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    """A piece of the arguments of the call at `index` (the pieces join to its arguments)."""

    index: int
    text: str


Event = Content | CallOpened | Arguments


@dataclass(frozen=True)
class ParsedText:
    """What one piece of output text made, in order."""

    events: tuple[Event, ...] = ()

    @property
    def content(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Content))


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


CALL_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


@dataclass
class _OpenCall:
    """A call being streamed as it is written: `{"name": ..., "arguments": ` seen, then its
    arguments' JSON text scanned up to the brace that closes them."""

    index: int
    id: str
    name: str
    start: int  # where the arguments begin in the call's text
    scanned: int = 0  # arguments' characters taken
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    closed: bool = False  # the arguments' closing brace was taken
    arguments: str = ""

    def take(self, text: str) -> str:
        """The arguments' new characters in the call's `text` so far."""
        piece = []
        for char in text[self.start + self.scanned :]:
            if self.closed:
                break
            self.scanned += 1
            if not self.depth and not piece and not self.arguments and char.isspace():
                continue
            piece.append(char)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                self.closed = self.depth <= 0
        fragment = "".join(piece)
        self.arguments += fragment
        return fragment


@dataclass
class ToolCallParser:
    """One choice's output, split into content and tool calls as it arrives.

    `incremental` (forced calls, whose shape the grammar guarantees): a call is opened as soon
    as its name is written and its arguments stream as they are written; otherwise a call is
    released whole once it is complete and parses."""

    format: str = HERMES
    incremental: bool = False
    calls: list[ToolCall] = field(default_factory=list)  # every call released so far
    _buffer: str = ""  # text not released yet: a possible tag, or a call being written
    _in_call: bool = False  # hermes: inside <tool_call>
    _open: _OpenCall | None = None  # incremental: the call being written
    _whitespace: str = ""  # content whitespace held until more content shows it is content
    _mode: str = "undecided"  # llama3_json: "undecided", "calls" (buffer all) or "content"

    def __post_init__(self) -> None:
        if self.format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool-call format must be one of {TOOL_CALL_FORMATS}")

    def push(self, text: str) -> ParsedText:
        if self.format == LLAMA3_JSON:
            return ParsedText(tuple(self._push_llama3(text)))
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE_TAG)
                if self.incremental:
                    events += self._stream_call(self._buffer if end < 0 else self._buffer[:end])
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG) :]
                self._in_call = False
                events += self._close_call(body)
                continue
            start = self._buffer.find(OPEN_TAG)
            if start < 0:
                held = _held_prefix(self._buffer, OPEN_TAG)
                cut = len(self._buffer) - held
                events += self._content(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                break
            events += self._content(self._buffer[:start])
            self._buffer = self._buffer[start + len(OPEN_TAG) :]
            self._in_call = True
        return ParsedText(tuple(events))

    def finish(self) -> ParsedText:
        """The rest at the end of the output: an unfinished call is content (an opened one
        stays a call, its arguments cut where the output ended)."""
        if self.format == LLAMA3_JSON:
            return ParsedText(tuple(self._finish_llama3()))
        events: list[Event] = []
        if self._open is not None:
            self._release_open()
        else:
            events += self._content((OPEN_TAG if self._in_call else "") + self._buffer)
        self._buffer, self._in_call, self._whitespace = "", False, ""
        return ParsedText(tuple(events))

    # ---- helpers -------------------------------------------------------------------------------
    def _content(self, text: str) -> list[Event]:
        """Content to release now: held whitespace goes out only before more content."""
        if not text:
            return []
        text = self._whitespace + text
        body = text.rstrip()
        self._whitespace = text[len(body) :]
        return [Content(body)] if body else []

    def _whole_call(self, call: ToolCall) -> list[Event]:
        self._whitespace = ""  # whitespace between content and a call is not content
        index = len(self.calls)
        self.calls.append(call)
        return [CallOpened(index, call.id, call.name), Arguments(index, call.arguments)]

    def _stream_call(self, text: str) -> list[Event]:
        """Incremental: open the call once its name is written, then its new arguments."""
        events: list[Event] = []
        if self._open is None:
            header = CALL_HEADER.match(text)
            if header is None:
                return []
            try:
                name = json.loads(header.group(1))
            except json.JSONDecodeError:
                return []
            self._whitespace = ""
            self._open = _OpenCall(len(self.calls), new_call_id(), name, header.end())
            events.append(CallOpened(self._open.index, self._open.id, name))
        fragment = self._open.take(text)
        if fragment:
            events.append(Arguments(self._open.index, fragment))
        return events

    def _close_call(self, body: str) -> list[Event]:
        if self._open is not None:
            self._release_open()
            return []
        call = read_call(body)
        if call is None:  # not a call after all: its text is content
            return self._content(OPEN_TAG + body + CLOSE_TAG)
        return self._whole_call(call)

    def _release_open(self) -> None:
        assert self._open is not None
        self.calls.append(ToolCall(self._open.id, self._open.name, self._open.arguments))
        self._open = None

    def _push_llama3(self, text: str) -> list[Event]:
        if self._mode == "content":
            return self._content(text)
        self._buffer += text
        if self._mode == "undecided":
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            self._mode = "calls" if stripped.startswith("{") else "content"
            if self._mode == "content":
                rest, self._buffer = self._buffer, ""
                return self._content(rest.lstrip())
        return self._stream_llama3() if self.incremental else []

    def _stream_llama3(self) -> list[Event]:
        """Incremental llama3_json: calls one after another, `; ` between them."""
        events: list[Event] = []
        while True:
            if self._open is None:  # between calls: the separator
                self._buffer = self._buffer.lstrip().removeprefix(";")
            events += self._stream_call(self._buffer)
            if self._open is None or not self._open.closed:
                return events
            rest = self._buffer[self._open.start + self._open.scanned :]
            end = rest.find("}")
            if end < 0:
                return events
            self._release_open()
            self._buffer = rest[end + 1 :]

    def _finish_llama3(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        self._whitespace = ""
        if self._open is not None:
            self._release_open()
            return []
        if self._mode != "calls" or not text.strip():
            return []
        pieces = _split_json_values(text)
        calls = [read_call(piece) for piece in pieces or []]
        if not calls or any(call is None for call in calls):
            return [Content(text.strip())]
        return [event for call in calls if call is not None for event in self._whole_call(call)]


def parse_tool_calls(
    text: str, format: str = HERMES, *, incremental: bool = False
) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when there is none) and tool calls, as a stream parsed
    with the same options shows them."""
    parser = ToolCallParser(format, incremental)
    content = parser.push(text).content + parser.finish().content
    return content or None, parser.calls
