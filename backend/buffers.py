"""Buffers for slot states, their pages brought in a chunk at a time before they are written.

    empty(n) -> np.ndarray        n bytes (uint8), contents undefined
    release_after(buf, n)         give the pages of `buf` past its first n bytes back

A state is tens of megabytes on the default model and gigabytes on a real one, and a snapshot
writes it into new memory on the compute thread, where every other slot waits. Touched page by
page, new memory costs a fault per 4 KiB page: on a 2-core AMD EPYC VM a 132 MiB buffer took
240-300 ms to touch and 43 ms with its pages populated by the kernel in one call, so a
6,345-token snapshot of the default model took 265-330 ms of the compute thread instead of
about 15 ms of copying (bench/results/issue41/README.md, "Snapshots in populated memory"). On
bare metal a fault is cheaper, but a state of gigabytes is a million of them.

Buffers of `POPULATE_MIN` bytes or more are private anonymous mappings whose pages are
populated `CHUNK` bytes at a time (`MADV_POPULATE_WRITE`, Linux 5.14; libc's `madvise` through
ctypes, so the GIL is free meanwhile). Not in one call (`MAP_POPULATE`): the kernel holds the
process's address-space lock while it populates, and every other thread's `mmap`, `munmap` or
`brk` (Python's allocator) waits for it. A 1 GiB file read populated so stopped a generating
slot for 2.55 s (`python -m bench.slot_share`: 2.11x its time per token, against 0.84x). The
mapping goes when the last reference to the array goes, as a numpy array's own memory does.
Smaller buffers, and where the mapping or the advice is missing (macOS, an older kernel), are
`np.empty` or a plain mapping whose pages come as they are written.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import Any

import numpy as np

POPULATE_MIN = 1 << 20  # below this a buffer is a few hundred pages at most: np.empty
CHUNK = 16 << 20  # populated per call: the address-space lock is held this long at most
MADV_POPULATE_WRITE = 23
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return f


_advise = _madvise()
_populates = _advise is not None  # until the kernel refuses the advice (before 5.14)


def empty(n: int) -> np.ndarray:
    """A writable uint8 array of n bytes, its pages in memory where the kernel can do it."""
    global _populates
    if n < POPULATE_MIN or not _populates:
        return np.empty(n, dtype=np.uint8)
    try:
        m = mmap.mmap(-1, n, flags=_FLAGS)
    except OSError:  # no mapping to be had (a limit): the allocator's way
        return np.empty(n, dtype=np.uint8)
    buf = np.frombuffer(m, dtype=np.uint8)
    assert _advise is not None
    at = buf.ctypes.data
    for start in range(0, n, CHUNK):
        if _advise(at + start, min(CHUNK, n - start), MADV_POPULATE_WRITE) != 0:
            _populates = False  # not this kernel: the pages come as they are written
            break
    return buf


def release_after(buf: np.ndarray, n: int) -> np.ndarray:
    """`buf` holding only its first n bytes in memory: an array of its own is shrunk in place
    (realloc), a mapping's whole pages past n are given back (`MADV_DONTNEED`; they would read
    as zeros). The same array, or the shrunk one."""
    base = buf.base.obj if isinstance(buf.base, memoryview) else buf.base
    if isinstance(base, mmap.mmap):
        start = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        if start < len(base) and hasattr(base, "madvise"):
            base.madvise(mmap.MADV_DONTNEED, start, len(base) - start)
        return buf
    buf.resize(n, refcheck=False)
    return buf
