"""The layout of a sequence's state as llama.cpp writes it (`llama_state_seq_get_data`), read
far enough to rebuild the cold run's cell layout on restore and to say where two states differ.

    parse(state, n_sections) -> SeqState      the KV sections (cells, positions, per-layer rows)
    pad_window(state) -> (state, first)       a window snapshot with its masked cells put back
    one_stream(state, n_caches)               a slot's state in a context of one KV stream's form
    many_streams(state, n_caches, n_stream)   and back, for a context of n_stream slots
    first_cells_in_place(buf, n, p)           a plain cache's state cut to its first p cells
    first_difference(a, b, n_sections) -> str where two states differ: section, layer, cell, pos

Why (issue 19): a hit must run the cold run's computation, into the same cells. A cold prefill
puts position p in cell p (one sequence, aligned batches, nothing freed). A snapshot of a
sliding-window cache holds only the cells its window still sees: llama.cpp skips the masked
ones when it writes the state, so a restore packs the window's cells from cell 0, the next batch
goes after them, and attention sums over the cells in another order than the cold run: other
bits (seen on an AMD EPYC: a snapshot at 513 of Gemma 3 answered differently). `pad_window`
puts a zero-filled cell back for each masked position in front of the window, so the restore
lays every position in the cell the cold run used; the padded cells stay masked (their
attention weight is exactly 0, and with flash attention they are skipped), so their contents
never reach a result.

The format (llama.cpp as vendored by llama-cpp-python 0.3.36; `llama_kv_cache::state_write`):

    u32 magic, i32 seq_id                            (llama_context::state_seq_get_data)
    per KV cache (iSWA: the base cache, then the window cache):
      u32 n_stream; per stream: u32 cell_count, and if cells:
        cell_count x (i32 pos, u32 n_seq_id, [12 bytes ext], n_seq_id x i32 seq_id)
        u32 v_trans, u32 n_layer
        n_layer x (i32 type, u64 row_size, cell_count rows)            K
        v_trans=0: n_layer x (i32 type, u64 row_size, cell_count rows) V
        v_trans=1: n_layer x (i32 type, u32 el_size, u32 n_embd, n_embd x cell_count elements)
    then, for a hybrid model, the recurrent state (not parsed here).

A context of several slots (`--parallel`, one KV stream per sequence) writes n_stream sections
per cache, all empty but the sequence's own, and reads only that count back. `one_stream` gives
such a state the one-stream form, the form every snapshot is kept in (a state file then restores
whatever --parallel the worker that reads it runs); `many_streams` turns it back before a
restore into such a context. The position of the non-empty section does not matter there: it is
read into the stream of the sequence it is restored to.

A state that does not parse this way raises ValueError; the start-up self-check
(`backend.selfcheck`) is what proves the whole mechanism on the user's build.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from backend import buffers

T = TypeVar("T")

EXT_BYTES = 12  # llama_kv_cell_ext: x, y, tok


@dataclass(frozen=True, slots=True)
class Rows:
    """One layer's K or V of one cache: `cell_count` rows of `row_bytes` at `offset` (for a
    transposed V, `n_embd` runs of `cell_count` elements of `el_bytes` each)."""

    offset: int
    type_id: int
    row_bytes: int  # per cell: row size, or n_embd * el_size for a transposed V
    el_bytes: int = 0  # transposed V only
    n_embd: int = 0  # transposed V only

    def cell_bytes(self, buf: bytes | memoryview, cell_count: int, i: int) -> bytes:
        """The bytes of cell i in this layer."""
        if not self.el_bytes:
            start = self.offset + i * self.row_bytes
            return bytes(buf[start:start + self.row_bytes])
        run = cell_count * self.el_bytes
        return b"".join(bytes(buf[self.offset + j * run + i * self.el_bytes:
                                  self.offset + j * run + (i + 1) * self.el_bytes])
                        for j in range(self.n_embd))


@dataclass(frozen=True, slots=True)
class Section:
    """One KV cache's part of a sequence state (one stream)."""

    start: int  # offset of its n_stream
    end: int
    cell_count: int
    positions: tuple[int, ...]
    ext: bool
    meta_offset: int  # first cell's metadata
    data_offset: int  # v_trans
    v_trans: bool
    k: tuple[Rows, ...]
    v: tuple[Rows, ...]


@dataclass(frozen=True, slots=True)
class SeqState:
    sections: tuple[Section, ...]
    rest: int  # offset of what follows the KV sections (a recurrent state, or the end)


def _meta_dtype(ext: bool) -> np.dtype:
    """One cell's metadata in a sequence state: pos, n_seq_id (1), [ext], seq_id."""
    fields = [("pos", "<i4"), ("n_seq", "<u4")]
    fields += [("ext", "<i4", (3,))] if ext else []
    return np.dtype([*fields, ("seq", "<i4")])


class _Reader:
    def __init__(self, buf: bytes | memoryview, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("the state ends early")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return int(v)

    def skip(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError("the state ends early")
        at = self.pos
        self.pos += n
        return at


def _section(r: _Reader, ext: bool) -> Section:
    start = r.pos
    if r.take("<I") != 1:
        raise ValueError("only one stream per sequence is supported")
    return _stream(r, ext, start)


def _stream(r: _Reader, ext: bool, start: int) -> Section:
    """One stream's cells of a KV cache, from its cell count on."""
    cells = r.take("<I")
    if cells == 0:
        return Section(start, r.pos, 0, (), ext, r.pos, r.pos, False, (), ())
    meta = r.skip(cells * _meta_dtype(ext).itemsize)
    # one sequence per cell: every entry has the same size, read at once (a restore's hot path)
    entries = np.frombuffer(r.buf, dtype=_meta_dtype(ext), count=cells, offset=meta)
    if (entries["n_seq"] != 1).any():
        raise ValueError("a cell of several sequences (or none) in a sequence state")
    if (entries["seq"] < 0).any() or (np.diff(entries["pos"]) <= 0).any():
        raise ValueError("cells out of position order, or of no sequence")
    positions = tuple(entries["pos"].tolist())
    data = r.pos
    v_trans = bool(r.take("<I"))
    n_layer = r.take("<I")
    k = []
    for _ in range(n_layer):
        t, row = r.take("<i"), r.take("<Q")
        k.append(Rows(r.skip(cells * row), t, row))
    v = []
    for _ in range(n_layer):
        t = r.take("<i")
        if not v_trans:
            row = r.take("<Q")
            v.append(Rows(r.skip(cells * row), t, row))
        else:
            el, n_embd = r.take("<I"), r.take("<I")
            v.append(Rows(r.skip(cells * el * n_embd), t, el * n_embd, el, n_embd))
    return Section(start, r.pos, cells, tuple(positions), ext, meta, data, v_trans,
                   tuple(k), tuple(v))


def parse(state: bytes | memoryview, n_sections: int, ext: bool | None = None) -> SeqState:
    """The first `n_sections` KV caches of a sequence state (1 for plain attention and a hybrid's
    attention, 2 for a sliding window: the base cache, then the window's). Whether cells carry
    the 12-byte extension (M-RoPE or per-layer embeddings models) is found by trying both
    when `ext` is None."""
    def read(ext: bool) -> SeqState:
        r = _Reader(state)
        r.take("<I")  # magic
        r.take("<i")  # seq id
        sections = tuple(_section(r, ext) for _ in range(n_sections))
        return SeqState(sections, r.pos)
    return _either_ext(read, ext)


def _either_ext(read: Callable[[bool], T], ext: bool | None) -> T:
    """`read(ext)`; where `ext` is unknown (None), without the 12-byte cell extension and, if
    the state does not parse that way, with it."""
    if ext is not None:
        return read(ext)
    try:
        return read(False)
    except ValueError:
        return read(True)


def pad_window(state: bytes | memoryview) -> tuple[bytes | memoryview, int]:
    """(a window snapshot whose window cache holds a masked zero-filled cell for every position
    before its first one, so a restore lays position p in cell p as the cold run did; the
    window's first real position). The state itself and 0 where nothing is missing."""
    s = parse(state, 2).sections[1]
    if s.cell_count == 0 or s.positions[0] == 0:
        return state, 0
    first, n = s.positions[0], s.cell_count  # positions are strictly increasing (parse)
    if s.positions[-1] != first + n - 1:
        raise ValueError("the window's cells are not one run of positions")
    buf, d = memoryview(state), first  # cells put back
    pad = np.zeros(d, dtype=_meta_dtype(s.ext))
    pad["pos"], pad["n_seq"] = np.arange(d), 1
    if s.ext:
        pad["ext"][:, 2] = -1  # no token (llama_kv_cell_ext's default)
    out: list[bytes | memoryview] = [
        buf[:s.start], struct.pack("<II", 1, n + d), pad.tobytes(),
        buf[s.meta_offset:s.data_offset + 8]]  # the kept cells' metadata; v_trans, n_layer
    for rows in (*s.k, *(v for v in s.v if not v.el_bytes)):
        out += [struct.pack("<iQ", rows.type_id, rows.row_bytes), bytes(d * rows.row_bytes),
                buf[rows.offset:rows.offset + n * rows.row_bytes]]
    for rows in (v for v in s.v if v.el_bytes):  # transposed V: each row of n cells padded
        run = n * rows.el_bytes
        kept = np.frombuffer(buf, np.uint8, rows.n_embd * run, rows.offset).reshape(
            rows.n_embd, run)
        padded = np.zeros((rows.n_embd, (n + d) * rows.el_bytes), np.uint8)
        padded[:, d * rows.el_bytes:] = kept
        out += [struct.pack("<iII", rows.type_id, rows.el_bytes, rows.n_embd), padded.data]
    out.append(buf[s.end:])
    return _join(out), first


Part = bytes | tuple[int, int]  # literal bytes, or (offset, length) of the state itself


def _one_stream_parts(state: bytes | memoryview, n_caches: int, ext: bool | None
                      ) -> list[Part] | None:
    """The one-stream form as parts in order (None: the state has that form already). Each part
    comes from at or after the bytes it replaces, so the parts can be laid down in place."""
    if n_caches == 0 or struct.unpack_from("<I", state, 8)[0] == 1:
        return None

    def read(ext: bool) -> list[Part]:
        r = _Reader(state, 8)
        out: list[Part] = [(0, 8)]
        for _ in range(n_caches):
            found: tuple[int, int] | None = None
            for _ in range(r.take("<I")):
                at = r.pos
                if _stream(r, ext, at).cell_count:
                    if found is not None:
                        raise ValueError("a sequence's cells in two streams")
                    found = (at, r.pos - at)
            out += [struct.pack("<I", 1), found if found is not None else struct.pack("<I", 0)]
        out.append((r.pos, len(state) - r.pos))  # a hybrid's recurrent state, as it is
        return out
    return _either_ext(read, ext)


def _join(parts: Sequence[bytes | memoryview]) -> memoryview:
    """The parts laid end to end in one new buffer: numpy's copies, which release the GIL (a
    1 GiB `b"".join` held it for 1.2 s, and the worker's compute thread with it, while the
    reader thread prepared a restore)."""
    arrays = [np.frombuffer(p, dtype=np.uint8) for p in parts]  # byte counts, whatever shape
    out = buffers.empty(sum(a.size for a in arrays))
    at = 0
    for a in arrays:
        out[at:at + a.size] = a
        at += a.size
    return memoryview(out)


def one_stream(state: bytes | memoryview, n_caches: int, ext: bool | None = None
               ) -> bytes | memoryview:
    """A sequence state written by a context of several KV streams, in the form a context of
    one stream writes (module docstring); a one-stream state as it is."""
    parts = _one_stream_parts(state, n_caches, ext)
    if parts is None:
        return state
    buf = memoryview(state)
    return _join([p if isinstance(p, bytes) else buf[p[0] : p[0] + p[1]] for p in parts])


def one_stream_in_place(buf: np.ndarray, n: int, n_caches: int) -> int:
    """`one_stream` of the state in `buf[:n]` (a uint8 array), rewritten within `buf`: no
    second buffer, no second copy of the cells (a slot's snapshot is most of the state, and on
    the hot path). Returns the new length."""
    parts = _one_stream_parts(memoryview(buf)[:n], n_caches, None)
    if parts is None:
        return n
    base, at = buf.ctypes.data, 0
    for p in parts:  # every part's source lies at or after `at`: memmove, front to back
        if isinstance(p, bytes):
            ctypes.memmove(base + at, p, len(p))
            at += len(p)
        else:
            ctypes.memmove(base + at, base + p[0], p[1])
            at += p[1]
    return at


def many_streams(state: bytes | memoryview, n_caches: int, n_stream: int,
                 ext: bool | None = None) -> bytes | memoryview:
    """A one-stream sequence state in the form a context of `n_stream` KV streams reads."""
    if n_caches == 0 or n_stream == 1:
        return state
    buf, empty = memoryview(state), struct.pack("<I", 0) * (n_stream - 1)

    def read(ext: bool) -> memoryview:
        r = _Reader(state, 8)
        out: list[bytes | memoryview] = [buf[:8]]
        for _ in range(n_caches):
            sec = _section(r, ext)
            out += [struct.pack("<I", n_stream), buf[sec.start + 4:sec.end], empty]
        out.append(buf[r.pos:])
        return _join(out)
    return _either_ext(read, ext)


def many_streams_in_place(buf: np.ndarray, n: int, n_caches: int, n_stream: int) -> int:
    """`many_streams` of the state in `buf[:n]` (a uint8 array with room after it: 4 bytes per
    extra stream per cache), made within `buf`: each cache's stream count patched, its empty
    streams' counts written after it, what follows moved right (memmove, from the end; no
    second buffer, no copy of a state of gigabytes where nothing follows its cache). Returns
    the new length."""
    if n_caches == 0 or n_stream == 1:
        return n
    grow = 4 * (n_stream - 1)
    assert len(buf) >= n + grow * n_caches, (len(buf), n, grow)
    state = memoryview(buf)[:n]

    def read(ext: bool) -> list[Section]:
        r = _Reader(state, 8)
        return [_section(r, ext) for _ in range(n_caches)]
    secs = _either_ext(read, None)
    base, end = buf.ctypes.data, secs[-1].end
    ctypes.memmove(base + end + grow * n_caches, base + end, n - end)  # a recurrent state
    for k in reversed(range(n_caches)):
        sec, shift = secs[k], k * grow
        ctypes.memset(base + sec.end + shift, 0, grow)
        if shift:
            ctypes.memmove(base + sec.start + shift, base + sec.start, sec.end - sec.start)
        struct.pack_into("<I", buf, sec.start + shift, n_stream)
    return n + grow * n_caches


def first_cells_in_place(buf: np.ndarray, n: int, p: int) -> int:
    """The state in `buf[:n]` (a uint8 array, one stream of one plain KV cache holding positions
    0..m-1 in cells 0..m-1, nothing after it) cut to its first p < m cells within `buf`: what a
    snapshot taken after `llama_memory_seq_rm(seq, p, -1)` holds, byte for byte, without
    cutting the live state back, taking a second snapshot or restoring the first (issue 41:
    that held the whole, the part and a restore's copy at once). Each part moves left, front to
    back (memmove). Returns the new length; ValueError where the state has another shape."""
    state = memoryview(buf)[:n]
    seq = parse(state, 1)
    s = seq.sections[0]
    m = s.cell_count
    if seq.rest != n or struct.unpack_from("<I", state, 8)[0] != 1:
        raise ValueError("not one stream of one KV cache with nothing after it")
    if not 0 < p < m or s.positions[0] != 0 or s.positions[-1] != m - 1:
        raise ValueError(f"cannot cut cells 0..{m - 1} to {p}")
    base, at = buf.ctypes.data, s.data_offset

    def move(src: int, size: int) -> None:
        nonlocal at
        ctypes.memmove(base + at, base + src, size)
        at += size

    struct.pack_into("<I", buf, s.start + 4, p)  # cell_count; the first p cells' metadata stay
    at = s.meta_offset + p * _meta_dtype(s.ext).itemsize
    move(s.data_offset, 8)  # v_trans, n_layer
    for rows in (*s.k, *s.v):
        head = 12  # i32 type and u64 row size, or i32 type, u32 el_size, u32 n_embd
        move(rows.offset - head, head)
        if not rows.el_bytes:
            move(rows.offset, p * rows.row_bytes)
            continue
        run = m * rows.el_bytes  # transposed V: each of its n_embd runs keeps p elements
        for j in range(rows.n_embd):
            move(rows.offset + j * run, p * rows.el_bytes)
    return at


def flip_bit(state: bytes | memoryview) -> bytes:
    """The state with the lowest bit of its first cache's last K row flipped: a restore that is
    off by one unit in the last place, the injected fault the self-check must catch."""
    s = parse(state, 1).sections[0]
    if not s.cell_count:
        return bytes(state)
    buf = bytearray(state)
    rows = s.k[0]
    buf[rows.offset + (s.cell_count - 1) * rows.row_bytes] ^= 1
    return bytes(buf)


def first_difference(a: bytes | memoryview, b: bytes | memoryview, n_sections: int
                     ) -> str | None:
    """None when the states are equal byte for byte; else where they first differ, in words
    (which cache, layer, K or V, cell and position; or the recurrent state)."""
    if bytes(a) == bytes(b):
        return None
    try:
        sa, sb = parse(a, n_sections), parse(b, n_sections)
    except ValueError as e:
        return f"the states differ and do not parse ({e})"
    for i, (x, y) in enumerate(zip(sa.sections, sb.sections, strict=True)):
        name = ("window cache" if i == 1 else "cache") if n_sections == 2 else "cache"
        if x.positions != y.positions:
            return (f"{name}: cells hold other positions ({_span(x.positions)} vs "
                    f"{_span(y.positions)})")
        for kind, rows_a, rows_b in (("K", x.k, y.k), ("V", x.v, y.v)):
            for layer, (ra, rb) in enumerate(zip(rows_a, rows_b, strict=True)):
                cells = [c for c in range(x.cell_count)
                         if ra.cell_bytes(a, x.cell_count, c) != rb.cell_bytes(b, y.cell_count, c)]
                if cells:
                    return (f"{name}: layer {layer} {kind} differs in {len(cells)} of "
                            f"{x.cell_count} cells, first at cell {cells[0]} (position "
                            f"{x.positions[cells[0]]})")
    return "the recurrent state differs" if bytes(a[sa.rest:]) != bytes(b[sb.rest:]) else \
        "the states differ outside the KV cells"


def _span(positions: tuple[int, ...]) -> str:
    return f"{positions[0]}..{positions[-1]}" if positions else "none"
