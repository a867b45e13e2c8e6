"""A request's `StructuredOutput` as an llguidance grammar, checked before it is admitted.

llguidance (Rust, MIT) was chosen over xgrammar and outlines-core: its masks are computed lazily
per token in tens of microseconds on a CPU, a matcher rolls back any number of consumed tokens
(a rejected draft path), it reports forced ("fast-forward") tokens, and its JSON-schema coverage
is the widest of the three.
"""

from __future__ import annotations

import functools
import json

import llguidance

from shared.errors import InvalidRequestError
from shared.values.sampling import StructuredOutput

ANY_JSON_OBJECT = '{"type": "object"}'
# JSON as models write it on one line: ", " and ": " between items, no other whitespace. Keys
# and punctuation are then forced by the schema (drafted for free); a schema's own
# "x-guidance" options override these.
JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar definition of a constraint (cached per constraint)."""
    return _grammar_text(structured.kind, structured.spec)


@functools.lru_cache(maxsize=256)
def _grammar_text(kind: str, spec: str) -> str:
    if kind == "choice":
        return llguidance.grammar_from("choice", _choices(spec))
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                ANY_JSON_OBJECT, defaults=JSON_OPTIONS
            )
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.LLMatcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as error:
        raise InvalidRequestError(f"invalid {kind}: {error}", param="response_format") from error


def _choices(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(
            "choice must be a JSON list of strings", param="guided_choice"
        ) from error
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError(
            "choice must be a non-empty list of strings", param="guided_choice"
        )
    return json.dumps(choices)


def check_structured(structured: StructuredOutput) -> None:
    """Raise InvalidRequestError naming what is wrong when the grammar does not compile."""
    _check(structured.kind, structured.spec)


@functools.lru_cache(maxsize=256)  # a grammar that does not compile raises: not cached
def _check(kind: str, spec: str) -> None:
    structured = StructuredOutput(kind, spec)
    grammar = grammar_text(structured)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        detail = "; ".join(messages) or "the grammar does not compile"
        raise InvalidRequestError(f"invalid {structured.kind}: {detail}", param="response_format")
