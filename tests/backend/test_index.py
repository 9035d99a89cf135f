"""The LMDB index over real state files: lookups, hit counting, deletion, growth past a full map,
and startup reconciliation after crashes (killed writers, lost files, stray files)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from backend import store
from backend.index import Entry, Index, ReconcileReport
from backend.keys import CacheKey, prefix_keys
from backend.store import CacheFault, read_state_file, state_path, write_state_file
from tests.entries import entry_of

REPO = Path(__file__).resolve().parents[2]
FP = bytes(range(16))
SALT = b"salt" * 4
IDS = list(range(1000, 1100))


def key_at(n: int) -> CacheKey:
    return prefix_keys(SALT, IDS, [n])[n]


def save(cache_dir: Path, index: Index, n: int, reason: str = "scoped") -> tuple[CacheKey, Entry]:
    """What the worker and proxy do together: write the state file, then commit the entry."""
    key = key_at(n)
    path, size_bytes, checksum = write_state_file(cache_dir, key, FP, IDS[:n], os.urandom(n * 64))
    entry = Entry(
        n_tokens=n,
        file=str(path.relative_to(cache_dir)),
        size_bytes=size_bytes,
        checksum=checksum,
        reason=reason,
        created_s=1_700_000_000.25,
        last_used_s=1_700_000_000.25,
        hits=0,
        fingerprint=FP,
        tenant="",
    )
    index.put(key, entry)
    return key, entry


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    with Index(tmp_path) as idx:
        yield idx


def test_put_get_roundtrip_of_every_field(tmp_path: Path, index: Index) -> None:
    key, entry = save(tmp_path, index, 40)
    assert entry_of(index, key) == entry
    odd = Entry(
        n_tokens=2**32 - 1,
        file="kv/ff/ünï.kv",
        size_bytes=2**40,
        checksum=2**64 - 1,
        reason="anchor-refresh",
        created_s=0.1,
        last_used_s=1e9 + 0.123456,
        hits=2**50,
        fingerprint=b"\x00" * 16,
        tenant="tenant/with ✓",
        prefix_of=key,
    )
    index.put(key_at(41), odd)
    assert entry_of(index, key_at(41)) == odd
    assert entry_of(index, key_at(42)) is None
    assert len(index) == 2


def test_touch_counts_hits(tmp_path: Path, index: Index) -> None:
    key, entry = save(tmp_path, index, 12)
    index.touch(key, 1_800_000_000.5)
    index.touch(key, 1_800_000_001.5)
    touched = entry_of(index, key)
    assert touched is not None
    assert (touched.hits, touched.last_used_s, touched.created_s) == (
        2,
        1_800_000_001.5,
        1.7e9 + 0.25,
    )
    index.touch(key_at(99), 1.0)  # evicted meanwhile: nothing to count
    assert entry_of(index, key_at(99)) is None


def test_delete_removes_entry_and_file(tmp_path: Path, index: Index) -> None:
    key, entry = save(tmp_path, index, 15)
    other, other_entry = save(tmp_path, index, 16)
    assert index.total_bytes() == entry.size_bytes + other_entry.size_bytes
    assert index.delete(key) == entry
    assert not (tmp_path / entry.file).exists()
    assert entry_of(index, key) is None
    assert index.delete(key) is None
    assert index.total_bytes() == other_entry.size_bytes
    (tmp_path / other_entry.file).unlink()  # already gone on disk: still fine
    assert index.delete(other) == other_entry
    assert (len(index), index.total_bytes()) == (0, 0)


def test_replacing_an_entry_keeps_total_bytes_right(tmp_path: Path, index: Index) -> None:
    key, entry = save(tmp_path, index, 30)
    _, bigger = save(tmp_path, index, 60)
    index.put(key, bigger)
    assert index.total_bytes() == 2 * bigger.size_bytes
    assert [e for _, e in index.entries()] == [bigger, bigger]


def test_entries_survive_a_reopen_and_clear_removes_everything(tmp_path: Path) -> None:
    with Index(tmp_path) as index:
        saved = dict(save(tmp_path, index, n) for n in (5, 6, 7))
    with Index(tmp_path) as index:
        assert dict(index.entries()) == saved
        assert index.total_bytes() == sum(e.size_bytes for e in saved.values())
        assert index.clear() == 3
        assert (len(index), index.total_bytes(), index.entries()) == (0, 0, [])
    assert list((tmp_path / "kv").rglob("*.kv")) == []


def test_a_full_map_grows_transparently(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="backend.index")
    entry = Entry(
        n_tokens=1,
        file="kv/00/" + "0" * 32 + ".kv",
        size_bytes=1,
        checksum=0,
        reason="continued",
        created_s=0.0,
        last_used_s=0.0,
        hits=0,
        fingerprint=FP,
        tenant="",
    )
    keys = [CacheKey(i.to_bytes(16, "big")) for i in range(5000)]
    with Index(tmp_path, map_size_bytes=64 << 10) as index:
        for i, key in enumerate(keys):
            index.put(key, replace(entry, n_tokens=i))
        index.touch(keys[0], 5.0)
        assert len(index) == 5000
        assert index.total_bytes() == 5000
    assert "index map full" in caplog.text  # it did fill up, more than once
    with Index(tmp_path, map_size_bytes=64 << 10) as index:
        got = dict(index.entries())  # once: a read per key scanned all 5000 each time (minutes)
        assert [got[k].n_tokens for k in keys] == list(range(5000))
        assert got[keys[0]].hits == 1


def test_reconcile_makes_index_and_files_agree(tmp_path: Path, index: Index) -> None:
    kept_key, kept = save(tmp_path, index, 10)
    lost_key, lost = save(tmp_path, index, 20)
    (tmp_path / lost.file).unlink()  # entry without its file
    short_key, short = save(tmp_path, index, 30)
    os.truncate(tmp_path / short.file, short.size_bytes - 1)  # file of the wrong size
    # complete files without an entry (the proxy died before recording them): adopted
    stray, size, checksum = write_state_file(tmp_path, key_at(40), FP, IDS[:40], b"s" * 40)
    # and one with a draft model's twin after the model's state (backend.store)
    twin, twin_size, twin_sum = write_state_file(tmp_path, key_at(45), FP, IDS[:45], b"s" * 45,
                                                 store.Twin(b"d" * 16, 30, b"t" * 90))
    # an orphan cut short, and one not named after a key: removed
    cut, _, _ = write_state_file(tmp_path, key_at(50), FP, IDS[:50], b"s" * 50)
    os.truncate(cut, cut.stat().st_size - 1)
    (stray.parent / "notakey.kv").write_bytes(stray.read_bytes())
    temp = stray.parent / ".tmp-deadbeef-xyz"
    temp.write_bytes(b"half a state")

    report = index.reconcile()

    assert report == ReconcileReport(
        temp_files_removed=1,
        missing_dropped=1,
        size_dropped=1,
        unreadable_dropped=0,
        orphans_removed=2,
        kept=3,
        orphans_adopted=2,
    )
    with_twin = entry_of(index, key_at(45))
    assert with_twin is not None and (with_twin.size_bytes, with_twin.checksum) == (twin_size,
                                                                                   twin_sum)
    adopted = entry_of(index, key_at(40))
    assert adopted is not None
    assert (adopted.n_tokens, adopted.file, adopted.size_bytes, adopted.checksum,
            adopted.reason, adopted.fingerprint) == (40, str(stray.relative_to(tmp_path)), size,
                                                     checksum, "adopted", FP)
    assert sorted(index.entries()) == sorted([(kept_key, kept), (key_at(40), adopted),
                                              (key_at(45), with_twin)])
    assert index.total_bytes() == kept.size_bytes + size + twin_size
    assert sorted(p for p in (tmp_path / "kv").rglob("*") if p.is_file()) == sorted(
        [tmp_path / kept.file, stray, twin])
    assert index.reconcile() == ReconcileReport(0, 0, 0, 0, 0, kept=3)  # idempotent


def test_reconcile_on_an_empty_cache(tmp_path: Path, index: Index) -> None:
    assert index.reconcile() == ReconcileReport(0, 0, 0, 0, 0, 0)


# --- a worker killed while saving -------------------------------------------------------------

WRITER = """
import os, signal, sys
from pathlib import Path
from backend.store import write_state_file
cache_dir, key, n, size, die_at_rename = sys.argv[1:]
if die_at_rename == "1":  # the temp file is complete and synced; the worker dies before rename
    os.replace = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
ids = list(range(1000, 1000 + int(n)))
write_state_file(Path(cache_dir), bytes.fromhex(key), bytes(range(16)), ids, bytes(int(size)))
"""


def start_writer(
    cache_dir: Path, key: CacheKey, n: int, size: int, die_at_rename: bool
) -> subprocess.Popen[bytes]:
    args = [str(cache_dir), key.hex(), str(n), str(size), "1" if die_at_rename else "0"]
    return subprocess.Popen([sys.executable, "-c", WRITER, *args], cwd=REPO)


def temps_in(cache_dir: Path) -> list[Path]:
    kv = cache_dir / "kv"
    return sorted(kv.rglob(".tmp-*")) if kv.is_dir() else []


def test_writer_killed_mid_write_leaves_nothing_behind_after_reconcile(
    tmp_path: Path, index: Index
) -> None:
    kept_key, kept = save(tmp_path, index, 10)
    key = key_at(50)
    writer = start_writer(tmp_path, key, 50, 256 << 20, die_at_rename=False)
    deadline = time.monotonic() + 30
    while not any(p.stat().st_size > 0 for p in temps_in(tmp_path) if p.exists()):
        assert writer.poll() is None, "the writer finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    os.kill(writer.pid, signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL
    partial = temps_in(tmp_path)
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    assert not state_path(tmp_path, key).exists()  # the final name never holds a partial file

    report = index.reconcile()

    assert report.temp_files_removed == 1 and report.kept == 1
    assert temps_in(tmp_path) == []
    assert index.entries() == [(kept_key, kept)]
    with pytest.raises(CacheFault) as info:
        read_state_file(state_path(tmp_path, key), FP, IDS)
    assert info.value.reason == "missing"


def test_writer_killed_before_rename_keeps_the_old_file_and_drops_a_premature_entry(
    tmp_path: Path, index: Index
) -> None:
    # an older complete snapshot of 20 tokens is being rewritten when the worker dies
    old_key, old = save(tmp_path, index, 20)
    rewrite = start_writer(tmp_path, old_key, 20, 1 << 20, die_at_rename=True)
    assert rewrite.wait() == -signal.SIGKILL
    # a new 60-token snapshot dies the same way; pretend the proxy had committed it too early
    new_key = key_at(60)
    _, template = save(tmp_path, index, 61)
    index.delete(key_at(61))
    index.put(new_key, replace(template, n_tokens=60, file="kv/x/gone.kv"))
    fresh = start_writer(tmp_path, new_key, 60, 1 << 20, die_at_rename=True)
    assert fresh.wait() == -signal.SIGKILL
    assert len(temps_in(tmp_path)) == 2

    report = index.reconcile()

    assert (report.temp_files_removed, report.missing_dropped, report.kept) == (2, 1, 1)
    assert temps_in(tmp_path) == []
    assert index.entries() == [(old_key, old)]
    assert read_state_file(tmp_path / old.file, FP, IDS)[0] == 20  # the old file is intact


def test_ring_persists_newest_capacity_in_order(tmp_path: Path) -> None:
    with Index(tmp_path) as index:
        for i in range(7):
            index.ring_push("t" if i % 2 else "", list(range(i, i + 5)), capacity=4)
    with Index(tmp_path) as index:  # reopened: what a restarted proxy sees
        ring = index.ring_load()
    # the 4 newest, oldest first, with their tenants and exact ids
    assert ring == [("t", (3, 4, 5, 6, 7)), ("", (4, 5, 6, 7, 8)), ("t", (5, 6, 7, 8, 9)),
                    ("", (6, 7, 8, 9, 10))]
