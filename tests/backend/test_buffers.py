"""State buffers (backend.buffers): a large one is in memory before anything touches it, and
gives back what it does not hold; a small one is an array of its own."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from backend import buffers

MiB = 1 << 20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="MADV_POPULATE_WRITE and /proc/self/status are Linux's")


def rss() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_buffer_holds_its_bytes_and_writes() -> None:
    for n in (0, 1, 4096, buffers.POPULATE_MIN - 1, buffers.POPULATE_MIN, 3 * MiB + 5):
        b = buffers.empty(n)
        assert b.dtype == np.uint8 and b.size == n and b.flags.writeable
        b[:] = 7
        assert bytes(memoryview(b)[-1:]) == (b"\x07" if n else b"")


@linux
def test_a_large_buffer_is_resident_before_it_is_touched() -> None:
    n = 64 * MiB
    before = rss()
    b = buffers.empty(n)
    grown = rss() - before
    if not buffers._populates:
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE (before Linux 5.14)")
    assert grown >= 0.9 * n, f"only {grown / MiB:.1f} MiB of {n / MiB:.0f} came in at once"
    del b
    assert rss() - before < 0.1 * n, "the mapping stayed after its array went"


@linux
def test_a_large_buffer_gives_back_the_pages_past_what_it_keeps() -> None:
    n, keep = 64 * MiB, 10 * MiB + 123
    b = buffers.empty(n)
    b[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
    expect = bytes(memoryview(b)[:keep])
    before = rss()
    kept = buffers.release_after(b, keep)
    assert kept is b and kept.size == n
    assert before - rss() >= 0.9 * (n - keep - mmap.PAGESIZE)
    assert bytes(memoryview(kept)[:keep]) == expect  # the bytes kept are as they were


def test_a_small_buffer_is_shrunk_to_what_it_keeps() -> None:
    b = buffers.empty(1000)
    b[:] = np.arange(1000) % 251
    expect = bytes(memoryview(b)[:10])
    kept = buffers.release_after(b, 10)
    assert kept.size == 10 and bytes(memoryview(kept)) == expect
