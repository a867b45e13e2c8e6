"""The stream-entry envelope: `v` (schema version), `t` (message type), `b` (msgpack payload).

Evolution is add-only: a reader accepts every version from 1 up. An older payload lacks the
fields added since, which take their defaults; a newer one has fields this reader does not know,
which it ignores. `v` tells a reader which fields the writer knew about.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from shared.wire.codec import (
    MalformedMessageError,
    PayloadReader,
    UnknownMessageTypeError,
    pack_payload,
    unpack_payload,
)
from shared.wire.schema import Schema

SCHEMA_VERSION = 1
MAX_TYPE_NAME = 64

Fields = Mapping[bytes, bytes] | Mapping[str, bytes] | Mapping[Any, Any]

_REGISTRY: dict[str, type[WireMessage]] = {}


class WireMessage:
    """Base of every message: a dataclass that sets TYPE and declares its fields with `wire()`."""

    TYPE: ClassVar[str]
    _schema: ClassVar[Schema | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("TYPE")
        if name is None:
            return
        if name in _REGISTRY:
            raise TypeError(f"message type {name!r} registered twice")
        _REGISTRY[name] = cls

    @classmethod
    def schema(cls) -> Schema:
        # built on first use: the @dataclass decorator runs after __init_subclass__
        if cls.__dict__.get("_schema") is None:
            cls._schema = Schema.declared_by(cls)
        assert cls._schema is not None
        return cls._schema

    def payload(self) -> dict[str, Any]:
        return self.schema().encode(self)

    @classmethod
    def from_payload(cls, fields: PayloadReader) -> Self:
        message: Self = cls.schema().decode(fields)
        return message

    def to_entry(self) -> dict[str, bytes]:
        return {
            "v": str(SCHEMA_VERSION).encode(),
            "t": self.TYPE.encode(),
            "b": pack_payload(self.payload()),
        }

    @classmethod
    def from_entry(cls, fields: Fields) -> Self:
        message = decode_entry(fields)
        if not isinstance(message, cls):
            raise MalformedMessageError(f"expected {cls.TYPE}, got {message.TYPE}")
        return message


def message_types() -> dict[str, type[WireMessage]]:
    return dict(_REGISTRY)


def _field(fields: Fields, name: str) -> bytes:
    value = fields.get(name.encode(), fields.get(name))
    if value is None:
        raise MalformedMessageError(f"stream entry has no {name!r} field")
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes):
        raise MalformedMessageError(f"stream entry field {name!r} is not bytes")
    return value


def entry_version(fields: Fields) -> int:
    raw = _field(fields, "v")
    if not raw.isdigit() or len(raw) > 6 or int(raw) < 1:
        raise MalformedMessageError(f"bad schema version {raw[:16]!r}")
    return int(raw)


def entry_type(fields: Fields) -> str:
    raw = _field(fields, "t")
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedMessageError(f"message type {raw[:MAX_TYPE_NAME]!r} is not ascii") from None
    if len(name) > MAX_TYPE_NAME:
        raise MalformedMessageError("message type name too long")
    return name


def decode_entry(fields: Fields) -> WireMessage:
    """A stream entry's fields -> its message; raises a ProtocolError subclass otherwise."""
    entry_version(fields)
    name = entry_type(fields)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise UnknownMessageTypeError(f"unknown message type {name!r}")
    payload = unpack_payload(_field(fields, "b"), name)
    return cls.from_payload(PayloadReader(payload, name))
