"""The one codec: every message and entry is a dataclass with declared fields, each with its
encoding and the bounds a reader checks.

A message declares its fields with `wire(kind)` (`Cancel.request_id: str = wire(Text(128))`); a
value type of a lower layer (`shared.values.steps.DraftRequest`), which must not know the wire,
gets its declaration here with `Schema.of(cls, name=kind, ...)`. `Schema.encode` writes the fields
in declared order, so the bytes are reproducible (the golden tests freeze them), and leaves out a
`Sparse` field that holds its default: fields added after version 1 are written only when set, so
a message that does not use them keeps its version-1 bytes. `Schema.decode` reads fields back by
name through the bounded `PayloadReader`; a field the payload lacks takes the dataclass default,
and one without a default is required.

Why our own codec and not msgspec: msgspec is not in the project's environment, its `Struct`
would have to replace the dataclasses of `shared.values` (a layer below the wire), and its encoder
writes every field, so keeping the golden version-1 bytes (sparse fields, packed int32 token
arrays, float16 feature matrices) would need these per-field rules anyway. msgpack, already a
dependency, does the bytes; this module only walks the declarations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from shared.wire.codec import PayloadReader, pack_ints

REQUIRED: Any = dataclasses.MISSING
DEFAULT_MAX_TEXT = 256


class Kind(Protocol):
    """How one field travels: `encode` gives the msgpack value, `read` checks it and decodes it."""

    def encode(self, value: Any) -> Any: ...

    def read(self, fields: PayloadReader, name: str, default: Any) -> Any: ...


def _or_required(default: Any) -> Any:
    """The PayloadReader convention: a default of None means the field is required."""
    return None if default is REQUIRED else default


@dataclass(frozen=True)
class Int:
    minimum: int | None = 0

    def encode(self, value: Any) -> int:
        return int(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> int:
        return fields.integer(name, _or_required(default), minimum=self.minimum)


@dataclass(frozen=True)
class OptInt:
    minimum: int | None = None

    def encode(self, value: Any) -> int | None:
        return None if value is None else int(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> int | None:
        value = fields.optional_integer(name)
        if value is not None and self.minimum is not None and value < self.minimum:
            fields.fail(name, f"must be >= {self.minimum}, got {value}")
        return value


@dataclass(frozen=True)
class Float:
    def encode(self, value: Any) -> float:
        return float(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> float:
        return fields.number(name, _or_required(default))


@dataclass(frozen=True)
class OptFloat:
    def encode(self, value: Any) -> float | None:
        return None if value is None else float(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> float | None:
        return fields.optional_number(name)


@dataclass(frozen=True)
class Flag:
    def encode(self, value: Any) -> bool:
        return bool(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> bool:
        return fields.flag(name, _or_required(default))


@dataclass(frozen=True)
class Text:
    max_len: int = DEFAULT_MAX_TEXT

    def encode(self, value: Any) -> str:
        return str(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> str:
        return fields.text(name, _or_required(default), max_len=self.max_len)


@dataclass(frozen=True)
class OptText:
    max_len: int = DEFAULT_MAX_TEXT

    def encode(self, value: Any) -> str | None:
        return value

    def read(self, fields: PayloadReader, name: str, default: Any) -> str | None:
        return fields.optional_text(name, max_len=self.max_len)


@dataclass(frozen=True)
class Texts:
    """A msgpack array of strings, each at most `max_len` characters."""

    max_len: int = DEFAULT_MAX_TEXT

    def encode(self, value: Any) -> list[str]:
        return list(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> tuple[str, ...]:
        return fields.texts(name, max_len=self.max_len)


@dataclass(frozen=True)
class TokenIds:
    """Token ids (each >= 0) as packed little-endian int32 bytes."""

    def encode(self, value: Any) -> bytes:
        return pack_ints(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> tuple[int, ...]:
        return fields.tokens(name, _or_required(default))


@dataclass(frozen=True)
class Value:
    """A value type with an encoding of its own (sampling options, trees, logprobs, ...)."""

    write: Callable[[Any], Any]
    parse: Callable[[PayloadReader, str], Any]

    def encode(self, value: Any) -> Any:
        return self.write(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> Any:
        return self.parse(fields, name)


@dataclass(frozen=True)
class Entries:
    """A msgpack array of maps, each one entry of `schema`."""

    schema: Schema

    def encode(self, value: Any) -> list[dict[str, Any]]:
        return [self.schema.encode(entry) for entry in value]

    def read(self, fields: PayloadReader, name: str, default: Any) -> tuple[Any, ...]:
        return tuple(self.schema.decode(entry) for entry in fields.subs(name))


@dataclass(frozen=True)
class Sparse:
    """Written only when it differs from the field's default (added after version 1)."""

    kind: Kind

    def encode(self, value: Any) -> Any:
        return self.kind.encode(value)

    def read(self, fields: PayloadReader, name: str, default: Any) -> Any:
        return self.kind.read(fields, name, default)


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    default: Any = REQUIRED

    def holds_default(self, value: Any) -> bool:
        if self.default is None or value is None:
            return value is self.default
        return bool(value == self.default)


@dataclass(frozen=True)
class Schema:
    """A dataclass's wire form: its fields in the order they are written."""

    cls: type
    fields: tuple[Field, ...]

    @classmethod
    def of(cls, target: type, **kinds: Kind) -> Schema:
        """`kinds` name every field of the dataclass `target`, in the order they travel."""
        declared = {f.name: f for f in dataclasses.fields(target)}
        if set(kinds) != set(declared):
            raise TypeError(f"{target.__name__}: wire fields {sorted(kinds)} != {sorted(declared)}")
        return cls(target, tuple(Field(n, k, declared[n].default) for n, k in kinds.items()))

    @classmethod
    def declared_by(cls, target: type) -> Schema:
        """The schema a dataclass declares with `wire(...)` on each of its fields."""
        kinds = {}
        for field in dataclasses.fields(target):
            if "wire" not in field.metadata:
                raise TypeError(f"{target.__name__}.{field.name} has no wire(...) declaration")
            kinds[field.name] = field.metadata["wire"]
        return cls.of(target, **kinds)

    def encode(self, value: Any) -> dict[str, Any]:
        payload = {}
        for name, write, skip in self._writers:
            item = getattr(value, name)
            if skip is None or not skip(item):
                payload[name] = write(item)
        return payload

    def decode(self, fields: PayloadReader) -> Any:
        values = {name: read(fields, name, default) for name, read, default in self._readers}
        return fields.build(self.cls, **values)

    # The declarations compiled once per schema into bound per-field functions, so encode and
    # decode do not look up each field's kind and class again for every message.
    @cached_property
    def _writers(self) -> tuple[_Writer, ...]:
        return tuple(
            (
                f.name,
                _unsparse(f.kind).encode,
                f.holds_default if isinstance(f.kind, Sparse) else None,
            )
            for f in self.fields
        )

    @cached_property
    def _readers(self) -> tuple[_Reader, ...]:
        return tuple((f.name, _unsparse(f.kind).read, f.default) for f in self.fields)


# (name, encode, holds_default for a Sparse field else None) and (name, read, default)
_Writer = tuple[str, Callable[[Any], Any], Callable[[Any], bool] | None]
_Reader = tuple[str, Callable[[PayloadReader, str, Any], Any], Any]


def _unsparse(kind: Kind) -> Kind:
    return kind.kind if isinstance(kind, Sparse) else kind


def wire(kind: Kind, default: Any = REQUIRED) -> Any:
    """Declare a message field: how it travels, and its default (none: required)."""
    return dataclasses.field(default=default, metadata={"wire": kind})
