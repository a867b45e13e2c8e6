"""Chat requests' `tools`, `tool_choice` and `parallel_tool_calls`, and the grammar of a call.

`tool_choice`: "auto" (the default with tools: the model may call; calls are parsed out of its
text), "none" (no calls: the tools are left out of the prompt and nothing is parsed),
"required" (at least one call) or `{"type": "function", "function": {"name": ...}}` (one call
of that function). A required or named call constrains the output (`StructuredOutput` of kind
"grammar") to the chat template's own call format with each function's parameter schema: one
call, or one or more when `parallel_tool_calls` (default true) and the choice is "required".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from services.gateway.errors import bad_request
from shared.errors import InvalidRequestError
from shared.text.tool_calls import HERMES, LLAMA3_JSON
from shared.values.sampling import MAX_STRUCTURED_SPEC_CHARS, StructuredOutput

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Tools:
    functions: tuple[Function, ...]
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function a named choice asks for
    parallel: bool = True

    @property
    def in_prompt(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the output must be tool calls (required or named)."""
        return self.choice in ("required", "named")


def parse_tools(body: Mapping[str, Any], chat: bool) -> Tools | None:
    """The request's tools (None: no tools, or tool_choice none without any)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not chat:
        for name, neutral in (("tools", (None, [])), ("tool_choice", (None, "none"))):
            if body.get(name) not in neutral:
                raise bad_request(f"{name} is for chat completions", name)
        return None
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    functions = _functions(tools)
    if not functions:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    kind, named = _choice(choice, functions)
    return Tools(functions, kind, named, parallel)


def _functions(tools: Any) -> tuple[Function, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools holds {len(tools)} tools, more than {MAX_TOOLS}", "tools")
    functions: list[Function] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where} must be an object with type function", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function must be an object", f"{where}.function")
        functions.append(_function(function, f"{where}.function"))
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise bad_request("tools name the same function twice", "tools")
    return tuple(functions)


def _function(function: Mapping[str, Any], where: str) -> Function:
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise bad_request(f"{where}.name must be 1 to 64 letters, digits, _ or -", f"{where}.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except SchemaError as error:
        path = "/".join(str(p) for p in error.path) or "(top)"
        raise bad_request(
            f"{where}.parameters is not a valid JSON schema at {path}: {error.message[:200]}",
            f"{where}.parameters",
        ) from None
    return Function(name, description, parameters)


def _choice(choice: Any, functions: Sequence[Function]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad_request(
                f"tool_choice must be none, auto, required or a function, got {choice[:32]!r}",
                "tool_choice",
            )
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    name = function.get("name")
    if name not in [f.name for f in functions]:
        raise bad_request(
            f"tool_choice names {str(name)[:64]!r}, which is not among the tools",
            "tool_choice.function.name",
        )
    return "named", name


# ---- the grammar of a forced call --------------------------------------------------------------
def call_constraint(tools: Tools, call_format: str) -> StructuredOutput:
    """An llguidance Lark grammar: the output is the forced call(s) in the template's format."""
    functions = [f for f in tools.functions if tools.named in (None, f.name)]
    names_key = "parameters" if call_format == LLAMA3_JSON else "arguments"
    rules = [
        f"call_{index}: %json {json.dumps(_call_schema(f, names_key))}"
        for index, f in enumerate(functions)
    ]
    call = "call: " + " | ".join(f"call_{index}" for index in range(len(functions)))
    many = tools.parallel and tools.choice == "required"
    if call_format == HERMES:
        tagged = 'tagged: "<tool_call>\\n" call "\\n</tool_call>"'
        start = 'start: tagged ("\\n" tagged)*' if many else "start: tagged"
        grammar = "\n".join([start, tagged, call, *rules])
    else:
        start = 'start: call ("; " call)*' if many else "start: call"
        grammar = "\n".join([start, call, *rules])
    if len(grammar) > MAX_STRUCTURED_SPEC_CHARS:
        raise bad_request(
            f"the tools' schemas make a grammar of {len(grammar)} characters; at most "
            f"{MAX_STRUCTURED_SPEC_CHARS} are accepted",
            "tools",
        )
    try:
        return StructuredOutput("grammar", grammar)
    except InvalidRequestError as error:
        raise bad_request(str(error), "tools") from None


def _call_schema(function: Function, arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            arguments_key: dict(function.parameters),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
        # llguidance's JSON allows any whitespace between tokens by default: a model may then
        # write whitespace until max_tokens; calls are written compact, as templates show them
        "x-guidance": COMPACT_JSON,
    }
