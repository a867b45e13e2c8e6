"""The metadata and tensor table of a GGUF file (v2, v3), read without its tensor data.

`gguf.GGUFReader` builds an array view per element of every metadata array, which for a
150 000-token vocabulary and its merges takes minutes on a busy CPU; checking a file before
converting it needs only its scalars, strings and tensor shapes, so arrays are skipped here.
Layout (little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; each
metadata entry a string key, a u32 value type and the value; each tensor a string name, u32
number of dimensions, u64 dimensions (innermost first), u32 element type, u64 data offset.
Strings are a u64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# value type -> struct format of the scalar types
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufArray:
    """A metadata array, skipped: its element type and length only."""

    element_type: int
    length: int


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    dims: tuple[int, ...]  # innermost first: a [out, in] weight is (in, out)
    ggml_type: int


@dataclass
class GgufHeader:
    version: int
    fields: dict[str, object] = field(default_factory=dict)
    tensors: list[GgufTensorInfo] = field(default_factory=list)


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = int(self.unpack("<Q"))
        text = bytes(self.data[self.pos : self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return text

    def skip_string(self) -> None:
        length = int(self.unpack("<Q"))  # (moves pos past the length first)
        self.pos += length

    def value(self, value_type: int) -> object:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type = int(self.unpack("<I"))
            length = int(self.unpack("<Q"))
            for _ in range(length):
                self.skip(element_type)
            return GgufArray(element_type, length)
        raise ValueError(f"unknown GGUF value type {value_type} at byte {self.pos}")

    def skip(self, value_type: int) -> None:
        if value_type in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[value_type])
        elif value_type == _STRING:
            self.skip_string()
        else:
            self.value(value_type)


def read_gguf_header(path: Path) -> GgufHeader:
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (magic {bytes(data[:4])!r})")
        cursor = _Cursor(data)
        cursor.pos = 4
        version = int(cursor.unpack("<I"))
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors = int(cursor.unpack("<Q"))
        num_fields = int(cursor.unpack("<Q"))
        header = GgufHeader(version)
        for _ in range(num_fields):
            key = cursor.string()
            value_type = int(cursor.unpack("<I"))
            header.fields[key] = cursor.value(value_type)
        for _ in range(num_tensors):
            name = cursor.string()
            num_dims = int(cursor.unpack("<I"))
            dims = tuple(int(cursor.unpack("<Q")) for _ in range(num_dims))
            ggml_type = int(cursor.unpack("<I"))
            cursor.unpack("<Q")  # data offset
            header.tensors.append(GgufTensorInfo(name, dims, ggml_type))
        return header
