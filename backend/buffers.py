"""Buffers for slot states, their pages faulted in at once.

    empty(n) -> np.ndarray        n bytes (uint8), contents undefined
    release_after(buf, n)         give the pages of `buf` past its first n bytes back

A state is tens of megabytes on the default model and gigabytes on a real one, and a snapshot
writes it into new memory on the compute thread, where every other slot waits. Touched page by
page, new memory costs a fault per 4 KiB page: on a 2-core AMD EPYC VM a 132 MiB buffer took
240-300 ms to touch and 43 ms mapped with the pages populated in one call (`MAP_POPULATE`), so
a 6,345-token snapshot of the default model took 265-330 ms of the compute thread instead of
about 15 ms of copying (bench/results/issue41/README.md, "Snapshots in populated memory"). On
bare metal a fault is cheaper, but a state of gigabytes is a million of them.

Buffers of `POPULATE_MIN` bytes or more are private anonymous mappings, populated (Linux); the
mapping goes when the last reference to the array goes, as a numpy array's own memory does.
Smaller ones, and where `MAP_POPULATE` is missing (macOS), are `np.empty`.
"""

from __future__ import annotations

import mmap

import numpy as np

POPULATE_MIN = 1 << 20  # below this a buffer is a few hundred pages at most: np.empty
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def empty(n: int) -> np.ndarray:
    """A writable uint8 array of n bytes, its pages already in memory."""
    if n < POPULATE_MIN or not _POPULATE:
        return np.empty(n, dtype=np.uint8)
    try:
        m = mmap.mmap(-1, n, flags=_FLAGS | _POPULATE)
    except OSError:  # no mapping to be had (a limit): the allocator's way
        return np.empty(n, dtype=np.uint8)
    return np.frombuffer(m, dtype=np.uint8)


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
