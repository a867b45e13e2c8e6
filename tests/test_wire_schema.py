"""The declared-field codec: every message round-trips, and its declarations carry the bounds."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import pytest

from shared.values.logprobs import TokenLogprobs
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams, TokenHistory
from shared.values.steps import DraftedTree, DraftRequest, VerifiedRequest, VerifyRequest
from shared.wire import (
    Cancel,
    CandidateTrees,
    DraftJob,
    Heartbeat,
    MalformedMessageError,
    RequestError,
    Submit,
    Tokens,
    VerifyJob,
    VerifyResult,
    WireMessage,
    decode_entry,
    message_types,
)
from shared.wire.codec import PayloadReader
from shared.wire.schema import Int, OptText, Schema, Sparse, Text, TokenIds, wire
from tests.test_protocol import FEATURES, added_in_v1, canonical_v1, make_tree

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LOGPROBS = TokenLogprobs((-0.5, -1.25), ((3, 4), (5, 6)), ((-0.5, -1.0), (-1.25, -2.0)))


def every_field_set() -> list[WireMessage]:
    """Messages with every optional field set, beside canonical_v1() and added_in_v1()."""
    history = TokenHistory(output_len=2, output=(4, 5), prompt=(1, 2), end_ids=(0,))
    sampling = SamplingParams(max_tokens=8, presence_penalty=0.5, min_tokens=1)
    draft = DraftRequest(
        "r", 1, 2, (4, 5), DraftMethod("beam", depth=2, width=2), sampling, 3,
        max_nodes=8, max_depth=3, features=FEATURES, history=history, app="chat",
    )  # fmt: skip
    prefill = VerifyRequest("p", 0, sampling, 3, 4, chunk=(1, 2), chunk_start=2, chunk_is_last=True)
    verify = VerifyRequest(
        "r", 1, sampling, 3, 4, tree=make_tree(), context_len=7, want_features=True,
        history=history,
    )  # fmt: skip
    verified = VerifiedRequest(
        "r", 1, (4,), 5, None, "oops", features=FEATURES, logprobs=LOGPROBS,
        cached_tokens=3, prompt_logprobs=LOGPROBS,
    )  # fmt: skip
    return [
        Submit("r", (1,), GREEDY, "out", 1.0, 2, 30.0, "tiny", False, "gold", "chat"),
        Cancel("r", "timeout"),
        Tokens(
            "r",
            1,
            0,
            (4, 5),
            None,
            1,
            2,
            1,
            "tiny",
            "gold",
            30.0,
            20.0,
            3,
            LOGPROBS,
            LOGPROBS,
        ),  # fmt: skip
        RequestError("r", "invalid_request", "bad", None),
        Heartbeat("verifier", "h", "0", 1.0, 2.0, None, 4, 1),
        DraftJob(1, (draft,), ("gone",)),
        CandidateTrees(
            1, "tiny", "h", 0.5, (DraftedTree("r", 1, make_tree()), DraftedTree("q", 0, None, "x"))
        ),
        VerifyJob(1, (prefill, verify), ("gone",)),
        VerifyResult(1, 2.0, (verified,)),
    ]


ALL_MESSAGES = [*canonical_v1().values(), *added_in_v1().values(), *every_field_set()]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda m: m.TYPE)
def test_every_message_round_trips_byte_for_byte(message: WireMessage) -> None:
    entry = message.to_entry()
    decoded = decode_entry(entry)
    assert type(decoded) is type(message)
    assert decoded.to_entry() == entry
    assert decoded.payload().keys() == message.payload().keys()


def test_round_trips_cover_every_message_type() -> None:
    assert {m.TYPE for m in every_field_set()} == set(message_types())


def test_messages_with_value_equality_decode_equal() -> None:
    for message in every_field_set():
        if type(message).__eq__ is not object.__eq__ and not isinstance(message, DraftJob):
            assert decode_entry(message.to_entry()) == message


@pytest.mark.parametrize("cls", sorted(message_types().values(), key=lambda c: c.TYPE))
def test_every_message_declares_every_field(cls: type[WireMessage]) -> None:
    names = [field.name for field in cls.schema().fields]
    assert names and len(names) == len(set(names))


@dataclass(frozen=True)
class _Probe:
    name: str = wire(Text(4))
    count: int = wire(Int(minimum=1))
    ids: tuple[int, ...] = wire(TokenIds(), ())
    note: str | None = wire(Sparse(OptText(8)), None)


PROBE = Schema.declared_by(_Probe)


def decode_probe(**payload: object) -> _Probe:
    fields = msgpack.unpackb(msgpack.packb(payload, use_bin_type=True), raw=False)
    probe: _Probe = PROBE.decode(PayloadReader(fields, "probe"))
    return probe


def test_declared_bounds_are_checked_on_decode() -> None:
    assert decode_probe(name="abcd", count=1) == _Probe("abcd", 1)
    with pytest.raises(MalformedMessageError, match=r"probe.name: longer than 4"):
        decode_probe(name="abcde", count=1)
    with pytest.raises(MalformedMessageError, match=r"probe.count: must be >= 1, got 0"):
        decode_probe(name="a", count=0)
    with pytest.raises(MalformedMessageError, match=r"probe.count: missing"):
        decode_probe(name="a")
    with pytest.raises(MalformedMessageError, match=r"probe.note: longer than 8"):
        decode_probe(name="a", count=1, note="x" * 9)
    with pytest.raises(MalformedMessageError, match=r"probe.ids: token ids must be >= 0"):
        decode_probe(name="a", count=1, ids=b"\xff\xff\xff\xff")


def test_sparse_fields_are_written_only_when_set() -> None:
    assert PROBE.encode(_Probe("a", 1)) == {"name": "a", "count": 1, "ids": b""}
    assert PROBE.encode(_Probe("a", 1, note="n"))["note"] == "n"


def test_a_schema_must_name_every_field_of_its_dataclass() -> None:
    with pytest.raises(TypeError, match="wire fields"):
        Schema.of(_Probe, name=Text())

    @dataclass(frozen=True)
    class Undeclared:
        name: str

    with pytest.raises(TypeError, match="no wire"):
        Schema.declared_by(Undeclared)
