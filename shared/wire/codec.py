"""msgpack payloads with bounded unpacking, packed arrays, and typed field access.

A payload is a msgpack map from field names to values. Writers put fields in a fixed order (so
the bytes are reproducible and golden-testable); readers look fields up by name, check their type,
ignore fields they do not know (a newer writer added them) and give defaults for fields a message
does not carry (an older writer did not know them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import msgpack
import numpy as np

from shared.errors import AuguryError

MAX_PAYLOAD_BYTES = 32 << 20
MAX_STR_BYTES = 1 << 20
MAX_ARRAY_ITEMS = 1 << 20
MAX_MAP_ITEMS = 4096

TOKEN_DTYPE = np.dtype("<i4")  # token ids and tree indices travel as int32 little-endian
FLOAT_DTYPE = np.dtype("<f8")
F16_DTYPE = np.dtype("<f2")  # hidden-state features travel as float16 little-endian, C order
MAX_FEATURE_ROWS = 4096
MAX_FEATURE_COLS = 8192

T = TypeVar("T")


class ProtocolError(AuguryError):
    """A stream entry we cannot turn into a message; the bus dead-letters it."""


class MalformedMessageError(ProtocolError):
    """Bad envelope, undecodable msgpack, or a field with the wrong type or value."""


class UnknownMessageTypeError(ProtocolError):
    """The entry's `t` names no message type this reader knows."""


def _no_ext(code: int, data: bytes) -> NoReturn:
    raise MalformedMessageError(f"msgpack ext type {code} is not part of the protocol")


def pack_payload(fields: Mapping[str, Any]) -> bytes:
    return msgpack.packb(dict(fields), use_bin_type=True, datetime=False, strict_types=True)


def unpack_payload(data: bytes, type_name: str) -> dict[str, Any]:
    # unpackb has no buffer bound of its own; the max_*_len bounds cap each object inside
    if len(data) > MAX_PAYLOAD_BYTES:
        raise MalformedMessageError(
            f"{type_name}: payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}"
        )
    try:
        payload = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            timestamp=0,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_PAYLOAD_BYTES,
            max_array_len=MAX_ARRAY_ITEMS,
            max_map_len=MAX_MAP_ITEMS,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        # truncated or trailing data, bad utf-8, over a size bound, unhashable map key, ...
        raise MalformedMessageError(f"{type_name}: undecodable payload: {error}") from error
    if not isinstance(payload, dict):
        raise MalformedMessageError(f"{type_name}: payload is {type(payload).__name__}, not a map")
    return payload


def pack_ints(values: Sequence[int] | np.ndarray) -> bytes:
    array = np.asarray(values, dtype=np.int64)
    if array.size and (array.min() < np.iinfo(TOKEN_DTYPE).min or array.max() > 2**31 - 1):
        raise ValueError("integer array values must fit in int32")
    return array.astype(TOKEN_DTYPE).tobytes()


def pack_floats(values: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=FLOAT_DTYPE).tobytes()


def pack_matrix_f16(matrix: np.ndarray) -> dict[str, Any]:
    """A 2-D matrix as {"rows", "cols", "data"}: its values as float16 bytes, row after row."""
    array = np.asarray(matrix)
    if array.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got {array.ndim} dimensions")
    rows, cols = array.shape
    if rows > MAX_FEATURE_ROWS or cols > MAX_FEATURE_COLS:
        raise ValueError(f"a matrix is at most {MAX_FEATURE_ROWS} x {MAX_FEATURE_COLS}")
    data = np.ascontiguousarray(array, dtype=F16_DTYPE).tobytes()
    return {"rows": int(rows), "cols": int(cols), "data": data}


class PayloadReader:
    """Typed access to one decoded payload map; every failure names the message and field.

    A getter without a default means the field is required (it has been there since version 1);
    fields added later always come with a default.
    """

    def __init__(self, payload: Mapping[str, Any], where: str) -> None:
        self._payload = payload
        self._where = where

    def fail(self, name: str, problem: str) -> NoReturn:
        raise MalformedMessageError(f"{self._where}.{name}: {problem}")

    def _get(self, name: str, kinds: tuple[type, ...], default: Any, required: bool) -> Any:
        if name not in self._payload:
            if required:
                self.fail(name, "missing")
            return default
        value = self._payload[name]
        # bool is an int subclass; keep the two apart
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            expected = " or ".join(k.__name__ for k in kinds)
            self.fail(name, f"expected {expected}, got {type(value).__name__}")
        return value

    def integer(self, name: str, default: int | None = None, *, minimum: int | None = None) -> int:
        value = int(self._get(name, (int,), default, default is None))
        if minimum is not None and value < minimum:
            self.fail(name, f"must be >= {minimum}, got {value}")
        return value

    def optional_integer(self, name: str) -> int | None:
        value = self._get(name, (int, type(None)), None, False)
        return None if value is None else int(value)

    def number(self, name: str, default: float | None = None) -> float:
        return float(self._get(name, (float, int), default, default is None))

    def optional_number(self, name: str) -> float | None:
        value = self._get(name, (float, int, type(None)), None, False)
        return None if value is None else float(value)

    def flag(self, name: str, default: bool | None = None) -> bool:
        return bool(self._get(name, (bool,), default, default is None))

    def text(self, name: str, default: str | None = None, *, max_len: int = 256) -> str:
        value: str = self._get(name, (str,), default, default is None)
        if len(value) > max_len:
            self.fail(name, f"longer than {max_len} characters")
        return value

    def optional_text(self, name: str, *, max_len: int = 256) -> str | None:
        value: str | None = self._get(name, (str, type(None)), None, False)
        if value is not None and len(value) > max_len:
            self.fail(name, f"longer than {max_len} characters")
        return value

    def texts(self, name: str, *, max_len: int = 256) -> tuple[str, ...]:
        items = self._get(name, (list,), [], False)
        for index, item in enumerate(items):
            if not isinstance(item, str) or len(item) > max_len:
                self.fail(f"{name}[{index}]", f"expected a string of at most {max_len} characters")
        return tuple(items)

    def tokens(self, name: str, default: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """Packed little-endian int32 bytes -> tuple of ints."""
        raw = self._get(name, (bytes,), None, default is None)
        if raw is None:
            return tuple(default or ())
        ids = self._frombuffer(name, raw, TOKEN_DTYPE)
        if ids.size and ids.min() < 0:
            self.fail(name, "token ids must be >= 0")
        return tuple(ids.tolist())

    def blob(self, name: str) -> bytes:
        """Opaque bytes (a nested encoding the caller decodes)."""
        value: bytes = self._get(name, (bytes,), None, True)
        return value

    def int_list(self, name: str) -> list[int]:
        """A plain msgpack array of integers."""
        items = self._get(name, (list,), None, True)
        for index, item in enumerate(items):
            if not isinstance(item, int) or isinstance(item, bool):
                self.fail(f"{name}[{index}]", "expected an integer")
        return list(items)

    def int_array(self, name: str) -> np.ndarray:
        raw = self._get(name, (bytes,), None, True)
        return self._frombuffer(name, raw, TOKEN_DTYPE).astype(np.int64)

    def float_array(self, name: str) -> np.ndarray:
        raw = self._get(name, (bytes,), None, True)
        return self._frombuffer(name, raw, FLOAT_DTYPE).astype(np.float64)

    def optional_f16_matrix(self, name: str) -> np.ndarray | None:
        """A pack_matrix_f16 map -> a float16 [rows, cols] array of its own (None when absent)."""
        matrix = self.optional_sub(name)
        if matrix is None:
            return None
        rows = matrix.integer("rows", minimum=0)
        cols = matrix.integer("cols", minimum=0)
        if rows > MAX_FEATURE_ROWS or cols > MAX_FEATURE_COLS:
            self.fail(name, f"at most {MAX_FEATURE_ROWS} x {MAX_FEATURE_COLS}, got {rows} x {cols}")
        raw = matrix.blob("data")
        if len(raw) != rows * cols * F16_DTYPE.itemsize:
            matrix.fail("data", f"{len(raw)} bytes do not hold {rows} x {cols} float16 values")
        return np.frombuffer(raw, dtype=F16_DTYPE).reshape(rows, cols).astype(np.float16)

    def _frombuffer(self, name: str, raw: bytes, dtype: np.dtype) -> np.ndarray:
        if len(raw) % dtype.itemsize:
            self.fail(
                name, f"{len(raw)} bytes is not a whole number of {dtype.itemsize}-byte items"
            )
        return np.frombuffer(raw, dtype=dtype)

    def sub(self, name: str) -> PayloadReader:
        value = self._get(name, (dict,), None, True)
        return PayloadReader(value, f"{self._where}.{name}")

    def optional_sub(self, name: str) -> PayloadReader | None:
        value = self._get(name, (dict, type(None)), None, False)
        return None if value is None else PayloadReader(value, f"{self._where}.{name}")

    def subs(self, name: str) -> list[PayloadReader]:
        items = self._get(name, (list,), None, True)
        readers = []
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                self.fail(f"{name}[{index}]", f"expected map, got {type(item).__name__}")
            readers.append(PayloadReader(item, f"{self._where}.{name}[{index}]"))
        return readers

    def build(self, make: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Construct a value, turning its own validation errors into protocol errors."""
        try:
            return make(*args, **kwargs)
        except (ValueError, TypeError) as error:
            raise MalformedMessageError(f"{self._where}: {error}") from error
