"""The request body's fields: each failure is the 400 naming the field, checked in a fixed order."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.body import APIError, GenerationRequest, parse_generation

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 + 1 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 60) for i in ids)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return [5, 6, 7]


def parse(**fields: Any) -> GenerationRequest:
    return parse_generation(
        {**BODY, **fields},
        chat=False,
        tokenizer=CharTokenizer(),
        model_name="m",
        vocab_size=64,
        max_context=64,
        call_format="hermes",
        slo_classes=("gold", "standard"),
    )


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"temperature": True}, "temperature must be a number", "temperature"),
        ({"seed": 1.5}, "seed must be an integer", "seed"),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean", "ignore_eos"),
        ({"top_k": -2}, "top_k must be positive, or -1 or 0 for off; got -2", "top_k"),
        (
            {"stop_token_ids": [64]},
            "stop_token_ids holds token ids outside [0, 64)",
            "stop_token_ids",
        ),
        ({"logit_bias": {"3": 200}}, "logit_bias values must be in [-100, 100]", "logit_bias"),
        ({"logprobs": 21}, "logprobs must be in [0, 20]", "logprobs"),
        ({"n": 17}, "n must be 1 to 16, got 17", "n"),
        ({"best_of": 0}, "best_of (0) must be at least n (1)", "best_of"),
        ({"priority": 2**40}, "priority is out of range", "priority"),
        (
            {"stream_options": {"include_usage": 1}},
            "include_usage must be a boolean",
            "include_usage",
        ),
        (
            {"augury": {"tpot_slo_ms": 0}},
            "augury.tpot_slo_ms must be a positive number",
            "augury.tpot_slo_ms",
        ),
        (
            {"augury": {"slo_class": "x"}},
            "unknown SLO class 'x'; known: gold, standard",
            "augury.slo_class",
        ),
        (
            {"augury": {"draft_model": ""}},
            "augury.draft_model must be 1 to 64 characters",
            "augury.draft_model",
        ),
        (
            {"augury": {"app": 3}},
            "augury.app must be a string of 1 to 128 characters",
            "augury.app",
        ),
        ({"augury": {"speculate": "no"}}, "speculate must be a boolean", "speculate"),
        ({"prompt": [1, True]}, "prompt must be a list of token ids", "prompt"),
        # the first failure in the fixed order is answered
        ({"top_p": "x", "temperature": "x"}, "temperature must be a number", "temperature"),
        ({"priority": "x", "n": 0}, "n must be 1 to 16, got 0", "n"),
        ({"stream": 1, "augury": {"app": ""}}, "augury.app must be", "augury.app"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(
    fields: dict[str, Any], message: str, param: str
) -> None:
    with pytest.raises(APIError) as raised:
        parse(**fields)
    error = raised.value
    assert (error.status, error.code) == (400, "invalid_request")
    assert error.message.startswith(message)
    assert error.param == param


def test_null_means_not_sent() -> None:
    sent = parse(temperature=None, n=None, stream=None, augury={"speculate": None})
    assert sent.sampling.temperature == 1.0 and sent.n == 1
    assert not sent.stream and sent.speculate


def test_fields_are_read_into_the_request() -> None:
    request = parse(
        temperature=0.5,
        top_k=-1,
        logit_bias={"3": 2},
        stream=True,
        stream_options={"include_usage": True},
        priority=-3,
        augury={"slo_class": "gold", "tpot_slo_ms": 40, "app": "chat", "speculate": False},
    )
    assert request.sampling.temperature == 0.5 and request.sampling.top_k == 0
    assert request.sampling.logit_bias == ((3, 2.0),)
    assert (request.stream, request.include_usage, request.priority) == (True, True, -3)
    assert (request.slo_class, request.tpot_slo_ms, request.app) == ("gold", 40.0, "chat")
    assert request.speculate is False
