"""State files: one llama.cpp sequence state per file, behind a self-checking header.

Layout (little-endian)::

    magic      4 bytes   b"PGKV"
    version    u16       VERSION
    flags      u16       0, reserved
    fingerprint 16 bytes model and configuration (keys.fingerprint)
    n_tokens   u32       the state holds KV for exactly these tokens
    ids        u32 * n_tokens
    state_len  u64       bytes of state that follow the header
    checksum   u64       xxh3_64 over every header field above, the ids, and the state
    state      state_len bytes

and, where a draft model's state of the same tokens goes with it (its *twin*: a worker with
`-md` keeps the draft model's KV beside the model's, as llama-server's prompt cache does)::

    magic      4 bytes   b"PGDT"
    fingerprint 16 bytes the draft model and its configuration
    n_tokens   u32       it holds KV for exactly the first n_tokens of the ids above
    state_len  u64
    checksum   u64       xxh3_64 over the twin's fields above and its state
    state      state_len bytes

Rules:

- A file is written to a temp file named ``.tmp-*`` in its final directory, fsynced, renamed
  onto :func:`state_path`, and the directory fsynced. A path returned by
  :func:`write_state_file` is complete and durable; a crash leaves only a temp file, which
  ``Index.reconcile`` sweeps at startup. The index entry is committed after the rename, by the
  proxy, never before. The bytes go past the page cache (O_DIRECT) where the file system takes
  it (`backend/direct_write.py`): a buffered write costs a core 2.4 ms per MiB here, taken
  from llama.cpp's.
- Only a regular file is opened (without blocking, then checked): a FIFO or device where a
  state file should be is a ``corrupt`` fault, a miss, never a hang.
- Verify before trust: :func:`read_state_file` checks magic, version, fingerprint, length,
  checksum, and that the stored ids equal the prompt's first n ids. Every failure is a
  :class:`CacheFault` with a reason from :data:`FAULT_REASONS`; callers treat it as a miss.
- A twin is read apart (:func:`read_twin_into`), verified the same way, and only by a worker
  whose draft model its fingerprint names. The model's state, its checksum and everything that
  reads it (the index, the shared tier, which publishes the model's part alone) do not depend
  on it; a bad twin costs the draft model's prefill, never the model's state.
- The state is read once, into one buffer: a 700 MB state must not be held twice in memory.
- Only the worker process reads and writes state bytes; the proxy sees paths, sizes, checksums.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import stat
import struct
import sys
import tempfile
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash

from backend import buffers, direct_write
from backend.keys import CacheKey
from policies.prefix import TokenIds

log = logging.getLogger(__name__)

MAGIC = b"PGKV"
VERSION = 1
FINGERPRINT_SIZE_BYTES = 16

FaultReason = Literal["missing", "truncated", "corrupt", "fingerprint", "tokens", "io"]
FAULT_REASONS: tuple[FaultReason, ...] = (
    "missing",
    "truncated",
    "corrupt",
    "fingerprint",
    "tokens",
    "io",
)

_FIXED = struct.Struct("<4sHH16sI")  # magic, version, flags, fingerprint, n_tokens
_STATE_LEN = struct.Struct("<Q")
_CHECKSUM = struct.Struct("<Q")
TWIN_MAGIC = b"PGDT"
_TWIN = struct.Struct("<4s16sIQQ")  # magic, fingerprint, n_tokens, state_len, checksum
_VERIFY_CHUNK_BYTES = 8 << 20
_MISMATCH_CONTEXT = 4  # tokens shown either side of the first mismatching token


class CacheFault(Exception):
    """A state file that cannot be trusted or written. Callers count it and treat it as a miss.

    ``reason`` is one of :data:`FAULT_REASONS` (a low-cardinality metric label); the message
    says what was wrong and where.
    """

    def __init__(self, reason: FaultReason, message: str = "", path: Path | None = None) -> None:
        assert reason in FAULT_REASONS, reason
        super().__init__(message or reason)
        self.reason: FaultReason = reason
        self.path = path


@dataclass(frozen=True, slots=True)
class StateHeader:
    magic: bytes
    version: int
    fingerprint: bytes
    n_tokens: int
    state_len: int  # bytes of state after the header
    checksum: int  # xxh3_64 as stored in the file
    state_offset: int  # where the state bytes start
    file_size_bytes: int  # size of the file on disk; state_offset + state_len when complete
    # (and a twin's header and state after it, where the file has one)


@dataclass(frozen=True, slots=True)
class Twin:
    """A draft model's state of the first `n_tokens` ids of the model's state it goes with."""

    fingerprint: bytes
    n_tokens: int
    state: bytes | bytearray | memoryview


def header_bytes(n_tokens: int) -> int:
    """The size of a header of `n_tokens` ids: where the state starts."""
    return _FIXED.size + 4 * n_tokens + _STATE_LEN.size + _CHECKSUM.size


def tokens_in_header(head: bytes | memoryview) -> int:
    """The token count a file's first bytes state (struct.error when too short)."""
    return int(_FIXED.unpack_from(head)[4])


def state_path(cache_dir: Path, key: CacheKey) -> Path:
    """Where the state of ``key`` lives: ``cache_dir/kv/<hex[:2]>/<hex>.kv``."""
    hex_key = key.hex()
    return Path(cache_dir) / "kv" / hex_key[:2] / f"{hex_key}.kv"


def write_state_file(
    cache_dir: Path,
    key: CacheKey,
    fp: bytes,
    ids: Sequence[int],
    state: bytes | bytearray | memoryview,
    twin: Twin | None = None,
) -> tuple[Path, int, int]:
    """Write the state for ``ids`` durably under ``key`` (with a draft model's `twin` after
    it); return (path, size_bytes, checksum: the model's state's).

    Any OSError (ENOSPC, EIO, permissions) becomes ``CacheFault("io")`` with no temp file left.
    """
    if len(fp) != FINGERPRINT_SIZE_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_SIZE_BYTES} bytes, got {len(fp)}")
    final = state_path(cache_dir, key)
    body = memoryview(state).cast("B")
    head = _FIXED.pack(MAGIC, VERSION, 0, fp, len(ids)) + _pack_u32(ids)
    head += _STATE_LEN.pack(body.nbytes)
    hasher = xxhash.xxh3_64(head)
    hasher.update(body)
    checksum = hasher.intdigest()
    head += _CHECKSUM.pack(checksum)
    parts: list[bytes | memoryview] = [head, body]
    if twin is not None:
        if len(twin.fingerprint) != FINGERPRINT_SIZE_BYTES or not 0 < twin.n_tokens <= len(ids):
            raise ValueError(f"a twin of {twin.n_tokens} tokens cannot go with {len(ids)}")
        twin_body = memoryview(twin.state).cast("B")
        parts += [_twin_head(twin.fingerprint, twin.n_tokens, twin_body), twin_body]

    tmp: Path | None = None
    try:
        new_dir = not final.parent.is_dir()
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(final.parent, final.stem)
        with open(fd, "wb") as f:
            if not direct_write.write_direct(f.fileno(), parts):
                for part in parts:
                    f.write(part)
                f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        tmp = None
        _fsync_dir(final.parent)
        if new_dir:
            _fsync_dir(final.parent.parent)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise CacheFault("io", f"could not write state file {final}: {e}", final) from e
    return final, sum(memoryview(p).nbytes for p in parts), checksum


def _twin_fields(fp: bytes, n_tokens: int, state_len: int) -> bytes:
    """A twin's header before its checksum: what the checksum covers with its state."""
    return _TWIN.pack(TWIN_MAGIC, fp, n_tokens, state_len, 0)[: -_CHECKSUM.size]


def _twin_head(fp: bytes, n_tokens: int, body: memoryview) -> bytes:
    fields = _twin_fields(fp, n_tokens, body.nbytes)
    hasher = xxhash.xxh3_64(fields)
    hasher.update(body)
    return fields + _CHECKSUM.pack(hasher.intdigest())


def read_state_file(path: Path, fp: bytes, prompt_ids: Sequence[int]) -> tuple[int, bytes]:
    """Return (n_tokens, state) after verifying the file against ``fp`` and the prompt."""
    n, buf = read_state_into(path, fp, prompt_ids)
    return n, buf.tobytes()


def read_state_into(path: Path, fp: bytes, prompt_ids: Sequence[int], spare: int = 0
                    ) -> tuple[int, np.ndarray]:
    """(n_tokens, the state) after verifying the file against ``fp`` and the prompt: the state
    read into a new uint8 array with `spare` bytes free after it (room for the form a context
    of several KV streams loads, made in place: backend.layout.many_streams_in_place). The
    read and the hash release the GIL: a worker's reader thread never holds up its compute
    thread."""
    with _open(path) as f:
        header, head = _read_head(f, path)
        if header.fingerprint != fp:
            raise CacheFault(
                "fingerprint",
                f"{path}: written for model/config {header.fingerprint.hex()}, "
                f"running {bytes(fp).hex()}",
                path,
            )
        _check_length(header, path, f)
        buf, view = _read_into(f, header.state_len, spare, path)
    hasher = xxhash.xxh3_64(head)
    hasher.update(view)
    _check_checksum(header.checksum, hasher.intdigest(), path)
    _check_tokens(head, header, prompt_ids, path)
    return header.n_tokens, buf


def read_header(path: Path, complete: bool = False) -> StateHeader:
    """The header alone (magic and version checked); the state bytes are not read.
    `complete`: the file is as long as its headers (a twin's too) say, else a CacheFault."""
    with _open(path) as f:
        header = _read_head(f, path)[0]
        if complete:
            _check_length(header, path, f)
        return header


def verify_file(path: Path) -> None:
    """Check structure, length and checksum without a prompt; streams the state in chunks."""
    with _open(path) as f:
        header, head = _read_head(f, path)
        twin = _check_length(header, path, f)
        f.seek(header.state_offset)
        _check_checksum(header.checksum, _hashed(f, head, header.state_len, path), path)
        if twin is not None:
            f.seek(twin.state_offset - _TWIN.size)
            fields = _read_exact(f, _TWIN.size, path, "twin's header")[: -_CHECKSUM.size]
            _check_checksum(twin.checksum, _hashed(f, fields, twin.state_len, path), path)


def _read_into(f: io.BufferedReader, n: int, spare: int, path: Path
               ) -> tuple[np.ndarray, memoryview]:
    """The next `n` bytes of `f`, read into a new uint8 array with `spare` bytes free after
    them: (the array, a view of the bytes read)."""
    buf = buffers.empty(n + spare)
    view, got = memoryview(buf)[:n], 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise CacheFault("truncated", f"{path}: file shrank while being read", path)
        got += k
    return buf, view


def _hashed(f: io.BufferedReader, head: bytes, n: int, path: Path) -> int:
    """xxh3_64 of `head` and the next `n` bytes of `f`, streamed in chunks."""
    hasher = xxhash.xxh3_64(head)
    buf = bytearray(min(_VERIFY_CHUNK_BYTES, max(n, 1)))
    view = memoryview(buf)
    while n:
        got = f.readinto(view[: min(n, len(buf))])
        if not got:
            raise CacheFault("truncated", f"{path}: file shrank while being read", path)
        hasher.update(view[:got])
        n -= got
    return hasher.intdigest()


@dataclass(frozen=True, slots=True)
class TwinHeader:
    fingerprint: bytes
    n_tokens: int
    state_len: int
    checksum: int
    state_offset: int


def read_twin_into(path: Path, fp: bytes, prompt_ids: Sequence[int], spare: int = 0
                   ) -> tuple[int, np.ndarray] | None:
    """(n_tokens, the state) of the file's twin (`read_state_into`'s checks, the token ids
    those of the model's state it goes with), read into a new uint8 array with `spare` bytes
    free after it; None where the file has no twin or one of another draft model (`fp`)."""
    with _open(path) as f:
        header, head = _read_head(f, path)
        twin = _check_length(header, path, f)
        if twin is None or twin.fingerprint != fp:
            return None
        f.seek(twin.state_offset)
        buf, view = _read_into(f, twin.state_len, spare, path)
    hasher = xxhash.xxh3_64(_twin_fields(twin.fingerprint, twin.n_tokens, twin.state_len))
    hasher.update(view)
    _check_checksum(twin.checksum, hasher.intdigest(), path)
    _check_tokens(head, header, prompt_ids, path)
    return twin.n_tokens, buf


def model_state_end(buf: bytes | memoryview) -> int:
    """Where the model's state ends in a state file's bytes (its twin, if any, after it)."""
    n = tokens_in_header(buf)
    (state_len,) = _STATE_LEN.unpack_from(buf, _FIXED.size + 4 * n)
    return header_bytes(n) + int(state_len)


def _create_temp(directory: Path, stem: str) -> tuple[int, Path]:
    """An open fd and path for a new ``.tmp-*`` file in ``directory`` (same filesystem)."""
    fd, name = tempfile.mkstemp(prefix=f".tmp-{stem[:8]}-", dir=directory)
    return fd, Path(name)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open(path: Path) -> io.BufferedReader:
    """``path`` opened for reading if it is a regular file. The open does not block
    (O_NONBLOCK: a FIFO would wait for a writer forever) and anything else is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise CacheFault("missing", f"{path}: no such state file", path) from e
    except OSError as e:
        raise CacheFault("io", f"{path}: cannot open: {e}", path) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CacheFault("corrupt", f"{path}: not a regular file "
                                        f"(mode {stat.filemode(mode)})", path)
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_head(f: io.BufferedReader, path: Path) -> tuple[StateHeader, bytes]:
    """Parse everything before the checksum; return the header and the bytes it was hashed as."""
    file_size = os.fstat(f.fileno()).st_size
    fixed = _read_exact(f, _FIXED.size, path, "header")
    magic, version, _flags, file_fp, n_tokens = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise CacheFault("corrupt", f"{path}: not a state file (magic {magic!r})", path)
    if version != VERSION:
        raise CacheFault("corrupt", f"{path}: format version {version}, expected {VERSION}", path)
    state_offset = _FIXED.size + 4 * n_tokens + _STATE_LEN.size + _CHECKSUM.size
    if file_size < state_offset:
        raise CacheFault(
            "truncated",
            f"{path}: {file_size} bytes, header of {n_tokens} tokens needs {state_offset}",
            path,
        )
    rest = _read_exact(f, 4 * n_tokens + _STATE_LEN.size, path, "token ids")
    (state_len,) = _STATE_LEN.unpack_from(rest, 4 * n_tokens)
    (checksum,) = _CHECKSUM.unpack(_read_exact(f, _CHECKSUM.size, path, "checksum"))
    header = StateHeader(
        magic=magic,
        version=version,
        fingerprint=file_fp,
        n_tokens=n_tokens,
        state_len=state_len,
        checksum=checksum,
        state_offset=state_offset,
        file_size_bytes=file_size,
    )
    return header, fixed + rest


def _read_exact(f: io.BufferedReader, n: int, path: Path, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CacheFault("truncated", f"{path}: file ends inside the {what}", path)
    return data


def _check_length(header: StateHeader, path: Path, f: io.BufferedReader) -> TwinHeader | None:
    """The file's length is its header's (and its twin's, read from `f` where the file goes on
    past the model's state); the twin's header, or None."""
    expected = header.state_offset + header.state_len
    size = header.file_size_bytes
    if size < expected:
        raise CacheFault("truncated", f"{path}: {size} bytes, header promises {expected}", path)
    if size == expected:
        return None
    past = f"{path}: {size - expected} bytes past the end of the state"
    if size < expected + _TWIN.size:
        raise CacheFault("corrupt", past, path)
    magic, fp, n, state_len, checksum = _TWIN.unpack(os.pread(f.fileno(), _TWIN.size, expected))
    if magic != TWIN_MAGIC or not 0 < n <= header.n_tokens:
        raise CacheFault("corrupt", past, path)
    if size != expected + _TWIN.size + state_len:
        raise CacheFault("truncated" if size < expected + _TWIN.size + state_len else "corrupt",
                         f"{path}: {size} bytes, its twin's header promises "
                         f"{expected + _TWIN.size + state_len}", path)
    return TwinHeader(fp, n, state_len, checksum, expected + _TWIN.size)


def _check_checksum(expected: int, actual: int, path: Path) -> None:
    if actual != expected:
        raise CacheFault(
            "corrupt",
            f"{path}: checksum {actual:016x}, header says {expected:016x}",
            path,
        )


def _check_tokens(head: bytes, header: StateHeader, prompt_ids: Sequence[int], path: Path) -> None:
    n = header.n_tokens
    stored = memoryview(head)[_FIXED.size : _FIXED.size + 4 * n]
    if len(prompt_ids) < n:
        raise CacheFault(
            "tokens", f"{path}: holds {n} tokens, the prompt has only {len(prompt_ids)}", path
        )
    try:
        if stored == _pack_u32(prompt_ids[:n]):
            return
    except OverflowError:
        pass  # a prompt id outside u32 cannot match; find and report it below
    stored_ids = _unpack_u32(stored)
    at = next((i for i in range(n) if stored_ids[i] != prompt_ids[i]), 0)
    lo, hi = max(0, at - _MISMATCH_CONTEXT), at + _MISMATCH_CONTEXT + 1
    raise CacheFault(
        "tokens",
        f"{path}: token {at} differs: stored {list(stored_ids[lo:hi])} "
        f"vs prompt {list(prompt_ids[lo:hi])} (from position {lo})",
        path,
    )


def _pack_u32(ids: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian bytes; OverflowError for an id outside u32."""
    if isinstance(ids, TokenIds):
        ids = np.asarray(ids)  # its packed bytes, read in place
    if hasattr(ids, "astype"):  # numpy: no per-element Python loop
        arr: Any = ids
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise OverflowError("token id outside u32")
        return bytes(arr.astype("<u4", copy=False).tobytes())
    packed = array("I", ids)
    assert packed.itemsize == 4, "this platform's C unsigned int is not 32 bits"
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack_u32(data: bytes | memoryview) -> array[int]:
    ids = array("I", bytes(data))
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


def read_ids(path: Path) -> tuple[int, ...]:
    """The token ids a state file's header names (the state bytes are not read): what a cache
    that lost an entry's path rebuilds it from."""
    with _open(path) as f:
        header, head = _read_head(f, path)
    ids = array("i")
    ids.frombytes(head[_FIXED.size : _FIXED.size + 4 * header.n_tokens])
    if sys.byteorder == "big":
        ids.byteswap()
    return tuple(ids)
