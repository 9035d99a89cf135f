"""Read the key/value metadata of a GGUF model file, nothing else.

Layout (GGUF v2/v3; v1 used 32-bit counts): magic ``GGUF``, version u32, tensor count, kv count,
then kv pairs ``key: string, type: u32, value``. A string is a length (u64) and UTF-8 bytes; an
array is an element type (u32), a count (u64) and the elements. Tensor infos follow the kv
section; this reader stops before them and never touches tensor data.

Rules:
- The file is memory-mapped and parsed with ``struct.unpack_from``; numeric arrays are unpacked
  in one call, string arrays with one slice per element. A 49K-token vocabulary plus merges reads
  in well under half a second.
- Arrays come back as lists, strings as ``str`` (invalid UTF-8 replaced, which GGUF writers do
  not produce), booleans as ``bool``.
- Byte order follows the file: a big-endian GGUF is detected from its version field.
- A malformed file raises ``GGUFError`` naming the path and the offset.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

__all__ = ["GGUFError", "read_metadata"]

_MAGIC = b"GGUF"

# value type -> struct format character; 7 (bool), 8 (string) and 9 (array) are handled apart
_SCALAR_FORMATS: dict[int, str] = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_BOOL, _STRING, _ARRAY = 7, 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands."""


class _Reader:
    def __init__(self, buf: mmap.mmap, path: str, order: str, count_fmt: str) -> None:
        self.buf = buf
        self.path = path
        self.order = order  # "<" or ">"
        self.count_fmt = order + count_fmt  # u64 since v2, u32 in v1
        self.count_size = struct.calcsize(self.count_fmt)
        self.off = 0

    def fail(self, why: str) -> GGUFError:
        return GGUFError(f"{self.path}: {why} at byte offset {self.off}")

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        fmt = self.order + fmt
        try:
            values = struct.unpack_from(fmt, self.buf, self.off)
        except struct.error as exc:
            raise self.fail(f"truncated metadata ({exc})") from None
        self.off += struct.calcsize(fmt)
        return values

    def count(self) -> int:
        try:
            (n,) = struct.unpack_from(self.count_fmt, self.buf, self.off)
        except struct.error:
            raise self.fail("truncated metadata") from None
        self.off += self.count_size
        return int(n)

    def string(self) -> str:
        n = self.count()
        end = self.off + n
        if end > len(self.buf):
            raise self.fail(f"string of {n} bytes runs past the end of the file")
        text = self.buf[self.off : end].decode("utf-8", "replace")
        self.off = end
        return text

    def value(self, vtype: int) -> Any:
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is not None:
            return self.unpack(fmt)[0]
        if vtype == _BOOL:
            return bool(self.unpack("B")[0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise self.fail(f"unknown value type {vtype}")

    def array(self) -> list[Any]:
        (etype,) = self.unpack("I")
        n = self.count()
        fmt = _SCALAR_FORMATS.get(etype)
        if fmt is not None:
            return list(self.unpack(f"{n}{fmt}"))
        if etype == _BOOL:
            return [bool(b) for b in self.unpack(f"{n}B")]
        if etype == _STRING:
            return self.string_array(n)
        return [self.value(etype) for _ in range(n)]  # nested arrays: rare, keep simple

    def string_array(self, n: int) -> list[str]:
        # The hot loop for vocabularies and merges: local names, one unpack and one slice each.
        buf, off, size = self.buf, self.off, self.count_size
        unpack_count = struct.Struct(self.count_fmt).unpack_from
        out: list[str] = [""] * n
        try:
            for i in range(n):
                (length,) = unpack_count(buf, off)
                off += size
                out[i] = buf[off : off + length].decode("utf-8", "replace")
                off += length
        except struct.error:
            self.off = off
            raise self.fail("truncated string array") from None
        if off > len(buf):
            self.off = off
            raise self.fail("string array runs past the end of the file")
        self.off = off
        return out


def read_metadata(path: str) -> dict[str, Any]:
    """Return the GGUF key/value metadata of ``path`` (tensor infos and data are not read)."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # empty file
            raise GGUFError(f"{path}: not a GGUF file ({exc})") from None
    try:
        return _read(buf, path)
    finally:
        buf.close()


def _read(buf: mmap.mmap, path: str) -> dict[str, Any]:
    if len(buf) < 8 or buf[:4] != _MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic)")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # a small version read with the wrong byte order
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (1, 2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version}")
    reader = _Reader(buf, path, order, "I" if version == 1 else "Q")
    reader.off = 8
    reader.count()  # tensor count, unused
    n_kv = reader.count()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = reader.string()
        (vtype,) = reader.unpack("I")
        metadata[key] = reader.value(vtype)
    return metadata
