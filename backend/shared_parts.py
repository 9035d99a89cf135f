"""Where the shared tier cuts a state file into parts, so that the snapshots of one prompt share
theirs (as LMCache keeps KV in chunks of tokens): a prompt's continued snapshots put the bytes
of their common prefix into Redis once, not once per snapshot.

    cuts(buf) -> [offsets]      where the parts of this state file begin (0 first)

A state file is its header (backend/store.py: magic, ..., the token ids, the checksum), then
llama.cpp's sequence state (backend/layout.py): per KV cache, the cells' metadata, then per
layer a block of K rows and a block of V rows, a row per cell, position p in cell p. The rows
of tokens [0, n) are the same bytes in every snapshot of a prompt that holds them (a snapshot
replays the cold run's batches: exact by construction), but in a longer snapshot they sit at
other offsets. So every block, and the cells' metadata, is cut at its start and every
`GROUP_TOKENS` cells from it: a snapshot of n tokens and one of m > n share every whole group
of the first n. What lies between (the header, counts, a block's last partial group, a
transposed V, a window's cache, a recurrent state) goes in the part before, and no part is
longer than `MAX_PART_BYTES`.

The cuts are only where to cut: whatever they are, the parts put back in order are the file,
byte for byte, and are verified as a whole. A state this cannot parse is cut every
MAX_PART_BYTES.
"""

from __future__ import annotations

import struct

from backend import layout, store

GROUP_TOKENS = 256  # cells per part of a block (LMCache's chunk size)
MAX_PART_BYTES = 8 << 20  # Redis strings stay far below their 512 MB limit


def cuts(buf: bytes | memoryview, size: int | None = None) -> list[int]:
    """The offsets where the parts of the state file `buf` (its first `size` bytes: a draft
    model's twin after the model's state is not cut) begin, ascending, 0 first."""
    size = len(buf) if size is None else size
    at = {0}
    try:
        state = store.header_bytes(store.tokens_in_header(buf))
        if state < size:
            for s in layout.parse(memoryview(buf)[state:size], 1).sections:
                at |= _section_cuts(s, state)
    except (ValueError, struct.error):
        pass  # not a state this parses: fixed-size parts only
    out: list[int] = []
    for start, end in zip(sorted(at), [*sorted(at)[1:], size], strict=True):
        out += range(start, end, MAX_PART_BYTES) if end > start else []
    return out


def _section_cuts(s: layout.Section, base: int) -> set[int]:
    """The cuts in one KV cache's section (offsets in the file: `base` is the state's)."""
    if not s.cell_count:
        return set()
    at: set[int] = set()
    meta_bytes = (s.data_offset - s.meta_offset) // s.cell_count
    at |= _groups(base + s.meta_offset, meta_bytes, s.cell_count)
    for rows in (*s.k, *(() if s.v_trans else s.v)):
        at |= _groups(base + rows.offset, rows.row_bytes, s.cell_count)
    return at


def _groups(start: int, row_bytes: int, cells: int) -> set[int]:
    """A block's start and every GROUP_TOKENS rows after it, within the block."""
    return {start + g * GROUP_TOKENS * row_bytes for g in range(0, -(-cells // GROUP_TOKENS))}
