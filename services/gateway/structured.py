"""A request's output constraint: `response_format`, vLLM's `guided_*` fields and its
`structured_outputs` object, as one `StructuredOutput`; compiled off the event loop.

    response_format: {"type": "text"}                  no constraint
                     {"type": "json_object"}           any JSON object
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
                                                           "strict": true}}
    guided_json: {...} (or its JSON text)  guided_regex: "..."  guided_choice: ["a", "b"]
    guided_grammar: a Lark grammar (llguidance's), or GBNF (`root ::= ...`), converted to Lark
    structured_outputs: {"json": ..., "regex": ..., "choice": [...], "grammar": ...}

At most one of them may constrain a request (a 400 names the second). `strict: false` is
constrained all the same. Checking compiles the grammar (llguidance) in a worker thread, bounded
by `gateway.structured_compile_timeout_s`; a grammar that does not compile, or not in time, is a
400 naming the field it came from.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from services.gateway.errors import bad_request
from shared.errors import InvalidRequestError
from shared.values.sampling import StructuredOutput

GUIDED_KINDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_OUTPUTS_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def parse_structured(body: Mapping[str, Any]) -> tuple[StructuredOutput, str] | None:
    """The request's constraint and the field it came from (None: unconstrained)."""
    found: list[tuple[StructuredOutput, str]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        schema = response_format.kind == "json_schema"
        found.append((response_format, f"response_format{'.json_schema.schema' * schema}"))
    for field, kind in GUIDED_KINDS.items():
        if body.get(field) is not None:
            found.append((_build(kind, body[field], field), field))
    found.extend(_structured_outputs(body.get("structured_outputs")))
    if len(found) > 1:
        raise bad_request(
            f"{found[0][1]} and {found[1][1]} both constrain the output; send one",
            found[1][1],
        )
    return found[0] if found else None


def _response_format(value: Any) -> StructuredOutput | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise bad_request(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}",
            "response_format.type",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("json_object", "", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON schema object",
            "response_format.json_schema.schema",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(
            "response_format.json_schema.strict must be a boolean",
            "response_format.json_schema.strict",
        )
    return _build("json_schema", spec["schema"], "response_format.json_schema.schema")


def _structured_outputs(value: Any) -> list[tuple[StructuredOutput, str]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    found = []
    for key, item in value.items():
        where = f"structured_outputs.{key}"
        if key not in STRUCTURED_OUTPUTS_KINDS:
            raise bad_request(
                f"{where} is not supported; known: {', '.join(STRUCTURED_OUTPUTS_KINDS)}", where
            )
        if item is not None:
            found.append((_build(STRUCTURED_OUTPUTS_KINDS[key], item, where), where))
    return found


def _build(kind: str, value: Any, field: str) -> StructuredOutput:
    """The constraint of one field's value, with its type checked (not yet compiled)."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise bad_request(f"{field} is not valid JSON", field) from None
        if not isinstance(value, dict | bool):
            raise bad_request(f"{field} must be a JSON schema object", field)
        spec = json.dumps(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{field} must be a non-empty list of strings", field)
        spec = json.dumps(value)
    elif kind == "json_object":
        spec = ""
    else:
        if not isinstance(value, str) or not value:
            raise bad_request(f"{field} must be a non-empty string", field)
        spec = _lark(value, field) if kind == "grammar" else value
    try:
        return StructuredOutput(kind, spec)
    except InvalidRequestError as error:
        raise bad_request(str(error), field) from None


def _lark(grammar: str, field: str) -> str:
    """A grammar as llguidance's Lark: GBNF (vLLM's and llama.cpp's `::=` rules) converted."""
    try:
        return any_to_lark(grammar)
    except GbnfToLarkError as error:
        raise bad_request(f"{field} is not a valid GBNF grammar: {error}", field) from None


def _check(structured: StructuredOutput) -> None:
    from shared.grammar.spec import check_structured  # llguidance's compiler, loaded on use

    check_structured(structured)


async def check_compiles(
    structured: StructuredOutput, field: str, executor: Executor, timeout_s: float
) -> None:
    """Compile the constraint in `executor`; a 400 naming `field` when it does not compile or
    takes longer than `timeout_s` (the worker finishes on its own; its result is dropped)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            await loop.run_in_executor(executor, _check, structured)
    except InvalidRequestError as error:
        raise bad_request(f"{field}: {error}", field) from None
    except TimeoutError:
        raise bad_request(
            f"{field}: the grammar did not compile within {timeout_s:g} s; simplify it", field
        ) from None
