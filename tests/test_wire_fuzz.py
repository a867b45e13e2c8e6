"""Fuzzing the wire decoder: whatever bytes arrive in a stream entry, `decode_entry` returns a
message or raises a `ProtocolError` (which the bus dead-letters with its reason); it never raises
anything else, never runs code and never allocates past the limits.

Every message type is mutated from its canonical version-1 entry, and the step messages also
from entries carrying the target's hidden-state features: truncated at every length class, bytes
flipped, bytes inserted, the envelope's version and type swapped, and payloads over the size
limit. `AUGURY_FUZZ_SCALE=N` tries N times as many mutations (see
tests/test_gateway_fuzz.py).
"""

from __future__ import annotations

import os
import random

import pytest

from shared.wire import ProtocolError, WireMessage, decode_entry
from shared.wire.codec import MAX_PAYLOAD_BYTES
from tests.test_protocol import added_in_v1, canonical_v1, want_features_job

MUTATIONS_PER_TYPE = 400 * int(os.environ.get("AUGURY_FUZZ_SCALE", "1"))


def fuzzed_messages() -> dict[str, WireMessage]:
    """Canonical messages by type name, and those with features as "<type>+features"."""
    with_features = {
        "draft_job": added_in_v1()["draft_job"],
        "verify_job": want_features_job(),
        "verify_result": added_in_v1()["verify_result"],
    }
    return canonical_v1() | {f"{name}+features": m for name, m in with_features.items()}


def mutate(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    match rng.randrange(4):
        case 0:  # truncated
            return bytes(data[: rng.randrange(len(data))])
        case 1:  # a few bytes flipped
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        case 2:  # bytes inserted
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        case _:  # a run overwritten with msgpack type markers (maps, arrays, ext, str32)
            at = rng.randrange(len(data))
            marker = rng.choice([0xDF, 0xDD, 0xC7, 0xD4, 0xDB, 0xC1, 0xDE, 0x9F])
            data[at] = marker
    return bytes(data)


@pytest.mark.parametrize("case", sorted(fuzzed_messages()))
def test_mutated_entries_decode_or_raise_a_protocol_error(case: str) -> None:
    entry = fuzzed_messages()[case].to_entry()
    rng = random.Random(case)
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(MUTATIONS_PER_TYPE):
        fields = dict(entry)
        fields["b"] = mutate(entry["b"], rng)
        try:
            message = decode_entry(fields)
        except ProtocolError:
            outcomes["refused"] += 1
        else:
            assert isinstance(message, WireMessage)
            outcomes["decoded"] += 1
    print(f"\nwire fuzz {case}: {outcomes}")
    assert outcomes["refused"] > MUTATIONS_PER_TYPE // 4  # the mutations do break things


@pytest.mark.parametrize(
    "fields",
    [
        {"v": b"99", "t": b"submit", "b": b"\x80"},  # a version from the future
        {"v": b"1", "t": b"nope", "b": b"\x80"},  # an unknown type
        {"v": b"one", "t": b"submit", "b": b"\x80"},
        {"v": b"1", "t": b"submit"},  # no payload
        {"v": b"1", "t": b"submit", "b": b"\x80", "extra": b"x"},
        {"v": b"1", "t": b"\xff\xfe", "b": b"\x80"},
        {"v": b"1", "t": b"submit", "b": b"\xdb" + (MAX_PAYLOAD_BYTES + 1).to_bytes(4, "big")},
    ],
)
def test_bad_envelopes_are_protocol_errors(fields: dict[str, bytes]) -> None:
    try:
        decode_entry(fields)
    except ProtocolError:
        return
    pytest.fail(f"decoded {fields!r}")


def test_an_oversized_payload_is_refused_before_unpacking() -> None:
    fields = dict(canonical_v1()["cancel"].to_entry())
    fields["b"] = b"\x80" + bytes(MAX_PAYLOAD_BYTES + 1)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_entry(fields)
