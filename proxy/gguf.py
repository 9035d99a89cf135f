"""Read the key/value metadata of a GGUF model file, nothing else.

Layout (GGUF v2/v3; v1 used 32-bit counts): magic ``GGUF``, version u32, tensor count, kv count,
then kv pairs ``key: string, type: u32, value``. A string is a length (u64) and UTF-8 bytes; an
array is an element type (u32), a count (u64) and the elements. Tensor infos follow the kv
section (name, dimension count u32, dimensions u64 each, ggml type u32, offset u64), then the
tensor data, aligned to ``general.alignment`` (32 by default). ``read_metadata`` stops before the
tensor infos; ``check_file`` reads them too and checks that every tensor's data lies inside the
file, so a file cut short anywhere is refused in one line before llama.cpp is given it. Neither
touches tensor data.

Rules:
- The file is memory-mapped and parsed with ``struct.unpack_from``; numeric arrays are unpacked
  in one call, string arrays with one slice per element. A 49K-token vocabulary plus merges reads
  in well under half a second.
- Arrays come back as lists, strings as ``str`` (invalid UTF-8 replaced, which GGUF writers do
  not produce), booleans as ``bool``.
- Byte order follows the file: a big-endian GGUF is detected from its version field.
- A malformed file raises ``GGUFError`` naming the path, what is wrong and the offset; never
  another exception, and never an allocation the file cannot back: a count (of pairs, tensors,
  array items) is checked against the bytes left in the file before anything is made for it
  (a string array claiming 2^26 entries in a small file is refused, not allocated).
- Only a regular file is opened (without blocking, then checked): a FIFO, a device or a
  directory given as a model is refused at once, never waited on.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from typing import Any

from backend import kv_override
from backend.kv_override import Override

__all__ = ["GGUFError", "check_file", "read_metadata"]

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
# the fewest bytes a value of each type takes (an array: its element type and count)
_MIN_VALUE_BYTES = {_BOOL: 1, _STRING: 8, _ARRAY: 12}

# ggml type -> (elements per block, bytes per block): gguf-py's GGML_QUANT_SIZES (a test checks
# that they agree); a type not listed is one llama.cpp may know: its size is not checked
GGML_TYPE_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98),
    19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1),
    25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54),
    35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT


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

    def count(self, what: str = "", min_bytes: int = 0) -> int:
        """A count; with `min_bytes`, refused when that many `what`s of at least `min_bytes`
        each cannot fit in what is left of the file (before anything is made for them)."""
        try:
            (n,) = struct.unpack_from(self.count_fmt, self.buf, self.off)
        except struct.error:
            raise self.fail("truncated metadata") from None
        self.off += self.count_size
        left = len(self.buf) - self.off
        if min_bytes and n * min_bytes > left:
            raise self.fail(f"{n} {what} claimed, more than the {left} bytes left in the file "
                            "can hold (a damaged or truncated file)")
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
        fmt = _SCALAR_FORMATS.get(etype)
        size = struct.calcsize(fmt) if fmt is not None else _MIN_VALUE_BYTES.get(etype, 1)
        n = self.count("array items", size)
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


def _map(path: str) -> mmap.mmap:
    """The file mapped for reading, if it is a non-empty regular file (opened without
    blocking: a FIFO would wait for a writer forever). OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) \
                else "a device or socket"
            raise GGUFError(f"{path}: not a regular file ({kind}); give the model's .gguf file")
        if os.fstat(fd).st_size < 8:
            raise GGUFError(f"{path} is not a GGUF model file ({os.fstat(fd).st_size} bytes)")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def read_metadata(path: str) -> dict[str, Any]:
    """Return the GGUF key/value metadata of ``path`` (tensor infos and data are not read)."""
    buf = _map(path)
    try:
        return _read(buf, path)[0]
    finally:
        buf.close()


def check_file(path: str) -> dict[str, Any]:
    """The metadata of a GGUF file whose layout llama.cpp can load: its key/value pairs and
    tensor infos parse, and every tensor's data lies inside the file. Raises GGUFError (one
    line: the path and what is wrong), or OSError when it cannot be opened."""
    buf = _map(path)
    try:
        metadata, reader, n_tensors = _read(buf, path)
        _check_tensors(reader, metadata, n_tensors)
        return metadata
    finally:
        buf.close()


def _check_tensors(reader: _Reader, metadata: dict[str, Any], n_tensors: int) -> None:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise reader.fail(f"general.alignment {alignment!r} is not a power of two")
    ends: list[tuple[int, str]] = []
    for _ in range(n_tensors):
        name = reader.string()
        (n_dims,) = reader.unpack("I")
        if not 0 < n_dims <= MAX_DIMS:
            raise reader.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = reader.unpack(f"{n_dims}Q")
        (ggml_type,) = reader.unpack("I")
        (offset,) = reader.unpack("Q")
        if offset % alignment:
            raise reader.fail(f"tensor {name!r} starts at {offset}, not a multiple of the "
                              f"alignment {alignment}")
        elements = 1
        for d in dims:
            elements *= d
        block, block_bytes = GGML_TYPE_SIZES.get(ggml_type, (1, 0))
        if elements % block:
            raise reader.fail(f"tensor {name!r} of {elements} elements is not whole blocks of "
                              f"{block} (type {ggml_type})")
        ends.append((offset + elements // block * block_bytes, name))
    if not ends:  # no tensors (a vocabulary-only file): no data section, no padding
        return
    data_start = -(-reader.off // alignment) * alignment
    end, name = max(ends)
    if data_start + end > len(reader.buf):
        raise GGUFError(f"{reader.path}: truncated: tensor {name!r} ends at byte "
                        f"{data_start + end}, the file has {len(reader.buf)} bytes (cut short: "
                        "copy or download it again)")


def _read(buf: mmap.mmap, path: str) -> tuple[dict[str, Any], _Reader, int]:
    """(the metadata, the reader at the tensor infos, the tensor count)"""
    if len(buf) < 8 or buf[:4] != _MAGIC:
        raise GGUFError(f"{path} is not a GGUF model file (bad magic)")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # a small version read with the wrong byte order
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (1, 2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version}")
    reader = _Reader(buf, path, order, "I" if version == 1 else "Q")
    reader.off = 8
    # a tensor info takes at least a name, a dimension count, a type and an offset; a pair a
    # key, a type and a one-byte value
    n_tensors = reader.count("tensors", 24)
    n_kv = reader.count("key/value pairs", 13)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = reader.string()
        (vtype,) = reader.unpack("I")
        metadata[key] = reader.value(vtype)
    return metadata, reader, n_tensors


def trained_ctx(path: str, overrides: tuple[Override, ...] = ()) -> int:
    """The context a GGUF model was trained with (`{arch}.context_length`, llama.cpp's
    n_ctx_train, as `--override-kv` may change it), for -c 0; a file that does not say is one
    line."""
    try:
        meta = kv_override.applied(read_metadata(path), overrides)
    except (OSError, GGUFError) as e:
        raise SystemExit(f"prefixgate: -c 0 takes the model's trained context, but {path} "
                         f"cannot be read: {getattr(e, 'strerror', None) or e}") from None
    n = meta.get(f"{meta.get('general.architecture')}.context_length")
    if not isinstance(n, int) or n <= 0:
        raise SystemExit(f"prefixgate: -c 0 takes the model's trained context, but {path} does "
                         "not say it; give -c N")
    return n
