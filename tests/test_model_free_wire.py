"""The application key (`augury.app`) from the HTTP body to the drafter: validated by the gateway
(400 naming the field), carried by Submit and DraftRequest only when set."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.body import APIError, parse_generation
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.wire import DraftJob, DraftRequest, Submit, decode_entry
from shared.wire.steps import draft_request_payload

GREEDY = SamplingParams(max_tokens=8)


class ByteTokenizer:
    """Enough of a tokenizer for parse_generation: one id per byte."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: Any, **_: Any) -> list[int]:
        return [ord(c) for m in messages for c in m["content"]]


def parse(extension: dict[str, Any]) -> Any:
    return parse_generation(
        {"model": "m", "prompt": "hello", "augury": extension},
        chat=False,
        tokenizer=ByteTokenizer(),
        model_name="m",
        vocab_size=256,
        max_context=64,
    )


def test_gateway_takes_an_application_key():
    assert parse({"app": "code-review"}).app == "code-review"
    assert parse({}).app == ""


@pytest.mark.parametrize("bad", [3, "", "x" * 129, ["a"]])
def test_gateway_refuses_a_bad_application_key(bad):
    with pytest.raises(APIError) as refused:
        parse({"app": bad})
    assert (refused.value.status, refused.value.param) == (400, "augury.app")


def test_submit_and_draft_request_carry_the_key_only_when_set():
    submit = Submit("r", (1, 2), GREEDY, "out", 1.0, app="sql")
    assert decode_entry(submit.to_entry()) == submit
    plain = Submit("r", (1, 2), GREEDY, "out", 1.0)
    assert "app" not in plain.payload()
    job = DraftJob(1, (DraftRequest("r", 0, 0, (1, 2), DraftMethod(), GREEDY, 0, app="sql"),))
    back = decode_entry(job.to_entry())
    assert isinstance(back, DraftJob) and back.entries[0].app == "sql"
    assert "app" not in draft_request_payload(
        DraftRequest("r", 0, 0, (1,), DraftMethod(), GREEDY, 0)
    )
    with pytest.raises(ValueError):
        DraftRequest("r", 0, 0, (1,), DraftMethod(), GREEDY, 0, app="x" * 129)
