"""The wire protocol: versioned msgpack messages in Redis stream entries.

Every entry has the fields `v` (schema version), `t` (message type) and `b` (msgpack map of
named fields). `message.to_entry()` builds the fields, `decode_entry(fields)` (or
`Cls.from_entry`) reads any known message back and raises a `ProtocolError` otherwise.
"""

from shared.wire.base import SCHEMA_VERSION, WireMessage, decode_entry, message_types
from shared.wire.codec import MalformedMessageError, ProtocolError, UnknownMessageTypeError
from shared.wire.requests import Cancel, Heartbeat, RequestError, Submit, Tokens
from shared.wire.steps import (
    CandidateTrees,
    DraftedTree,
    DraftJob,
    DraftRequest,
    VerifiedRequest,
    VerifyJob,
    VerifyRequest,
    VerifyResult,
)
from shared.wire.values import DraftMethod, FinishReason

__all__ = [
    "SCHEMA_VERSION",
    "CandidateTrees",
    "Cancel",
    "DraftJob",
    "DraftMethod",
    "DraftRequest",
    "DraftedTree",
    "FinishReason",
    "Heartbeat",
    "MalformedMessageError",
    "ProtocolError",
    "RequestError",
    "Submit",
    "Tokens",
    "UnknownMessageTypeError",
    "VerifiedRequest",
    "VerifyJob",
    "VerifyRequest",
    "VerifyResult",
    "WireMessage",
    "decode_entry",
    "message_types",
]
