"""A damaged cache directory on real files and real LMDB: something other than a regular file
where a state file should be is a miss (never a hang), and a damaged index (a truncated
data.mdb, broken meta pages) is moved aside at open and rebuilt from the state files, in a
process that survives it (a truncated file mapped by LMDB would be a SIGBUS)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from backend.index import Entry, Index
from backend.index_damage import _LMDB_META, find_damage
from backend.keys import CacheKey, prefix_keys
from backend.store import (
    CacheFault,
    read_header,
    read_state_file,
    state_path,
    verify_file,
    write_state_file,
)
from tests.entries import entry_of

REPO = Path(__file__).resolve().parents[2]
FP = bytes(range(16))
SALT = b"salt" * 4
N_ENTRIES = 30
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # LMDB's page size on this machine


# --- state files that are not regular files ---------------------------------------------------


def ids_of(k: int) -> list[int]:
    return [1000 * k + j for j in range(10 + k)]


def key_of(k: int) -> CacheKey:
    ids = ids_of(k)
    return prefix_keys(SALT, ids, [len(ids)])[len(ids)]


def not_a_file(kind: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")  # a character device: endless zeros


def without_hanging(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` in a thread; the exception it raised. Fails if it is still running after 5 s
    (a blocking open of a FIFO would never return; the thread is left behind as a daemon)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # handed to the test
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "hung"
    return raised[0] if raised else None


@pytest.mark.parametrize("kind", ["fifo", "directory", "character device"])
def test_a_state_file_that_is_not_a_regular_file_is_a_corrupt_fault(tmp_path: Path,
                                                                    kind: str) -> None:
    path = state_path(tmp_path, key_of(1))
    not_a_file(kind, path)
    for call in (lambda: read_state_file(path, FP, ids_of(1)), lambda: read_header(path),
                 lambda: verify_file(path)):
        fault = without_hanging(call)
        assert isinstance(fault, CacheFault) and fault.reason == "corrupt", fault
        assert "not a regular file" in str(fault)


def test_reconcile_removes_a_fifo_named_like_a_state_file(tmp_path: Path) -> None:
    with Index(tmp_path) as index:
        save(tmp_path, index, 1)
        fifo = state_path(tmp_path, key_of(2))
        not_a_file("fifo", fifo)
        report = without_hanging(index.reconcile)
        assert report is None  # returned normally
        assert not fifo.exists()
        assert [k for k, _ in index.entries()] == [key_of(1)]


# --- a damaged index --------------------------------------------------------------------------


def save(cache_dir: Path, index: Index, k: int) -> Entry:
    """What the worker and proxy do together: write the state file, then commit the entry."""
    ids = ids_of(k)
    path, size_bytes, checksum = write_state_file(cache_dir, key_of(k), FP, ids,
                                                  os.urandom(64 * len(ids)))
    entry = Entry(n_tokens=len(ids), file=str(path.relative_to(cache_dir)), size_bytes=size_bytes,
                  checksum=checksum, reason="scoped", created_s=1.0, last_used_s=1.0, hits=0,
                  fingerprint=FP, tenant="")
    index.put(key_of(k), entry)
    return entry


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """A cache of N_ENTRIES state files and their index, with a ring big enough that data.mdb
    spans many pages."""
    with Index(tmp_path) as index:
        for k in range(N_ENTRIES):
            save(tmp_path, index, k)
        for k in range(20):
            index.ring_push("", list(range(k, k + 1000)), capacity=100)
    assert (tmp_path / "index.lmdb" / "data.mdb").stat().st_size > 16 * PAGE_BYTES
    return tmp_path


def truncate(data: Path) -> None:
    os.truncate(data, 3 * PAGE_BYTES)


def random_meta_pages(data: Path) -> None:
    with data.open("r+b") as f:
        f.write(os.urandom(2 * PAGE_BYTES))


def one_bad_magic(data: Path) -> None:
    with data.open("r+b") as f:
        f.seek(PAGE_BYTES + 16)  # meta page 1, past the page header: mm_magic
        f.write(b"\0\0\0\0")


def last_page_past_the_end(data: Path) -> None:
    """Both meta pages claim a million pages: a file shorter than its meta says."""
    last_pg = _LMDB_META.size - 2 * struct.calcsize("N")  # mm_last_pg's offset in the page
    with data.open("r+b") as f:
        for page in (0, 1):
            f.seek(page * PAGE_BYTES + last_pg)
            f.write(struct.pack("N", 1_000_000))


def main_root_overwritten(data: Path) -> None:
    """The meta pages are sound; the page they name as the main database's root is not (LMDB
    itself reports it, at open)."""
    with data.open("r+b") as f:
        metas = []
        for page in (0, 1):
            f.seek(page * PAGE_BYTES)
            metas.append(_LMDB_META.unpack(f.read(_LMDB_META.size)))
        newest = max(metas, key=lambda m: m[-1])  # the higher txnid
        f.seek(newest[24] * PAGE_BYTES)  # MAIN_DBI's md_root
        f.write(b"\xff" * PAGE_BYTES)


DAMAGES = {
    "truncated to three pages": truncate,
    "both meta pages overwritten with random bytes": random_meta_pages,
    "meta page 1's magic zeroed": one_bad_magic,
    "meta pages claim a million pages": last_page_past_the_end,
    "the main database's root page overwritten": main_root_overwritten,
}

OPEN_AND_RECONCILE = """
import json, logging, sys
from pathlib import Path
from backend.index import Index
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
with Index(Path(sys.argv[1])) as index:
    report = index.reconcile()
    print(json.dumps({"damaged": index.damaged and index.damaged.name,
                      "adopted": report.orphans_adopted, "kept": report.kept,
                      "entries": sorted((k.hex(), e.n_tokens, e.reason)
                                        for k, e in index.entries())}))
"""


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_a_damaged_index_is_moved_aside_and_rebuilt_from_the_state_files(
    cache_dir: Path, damage: Callable[[Path], None]
) -> None:
    damage(cache_dir / "index.lmdb" / "data.mdb")
    damaged_bytes = (cache_dir / "index.lmdb" / "data.mdb").read_bytes()
    assert find_damage(cache_dir) is not None

    # a separate process: were LMDB to map the truncated file, it would die of SIGBUS
    child = subprocess.run([sys.executable, "-c", OPEN_AND_RECONCILE, str(cache_dir)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert result["adopted"] == result["kept"] == N_ENTRIES
    assert result["entries"] == sorted(
        [key_of(k).hex(), len(ids_of(k)), "adopted"] for k in range(N_ENTRIES))
    warnings = child.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("WARNING cache index"), warnings
    assert "is damaged" in warnings[0] and result["damaged"] in warnings[0]

    aside = cache_dir / result["damaged"]  # the damaged copy, kept for a look
    assert aside.name.startswith("index.lmdb.damaged-")
    assert (aside / "data.mdb").read_bytes() == damaged_bytes
    assert find_damage(cache_dir) is None
    with Index(cache_dir) as index:  # the rebuilt index is an ordinary one from now on
        assert index.damaged is None and len(index) == N_ENTRIES
        for k in range(N_ENTRIES):
            entry = entry_of(index, key_of(k))
            assert entry is not None
            n, _ = read_state_file(cache_dir / entry.file, FP, ids_of(k))
            assert n == len(ids_of(k))


def test_an_intact_index_is_opened_as_it_is(cache_dir: Path) -> None:
    assert find_damage(cache_dir) is None
    with Index(cache_dir) as index:
        assert index.damaged is None and len(index) == N_ENTRIES
        assert len(index.ring_load()) == 20
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith("index.lmdb")] == \
        ["index.lmdb"]
    assert find_damage(cache_dir / "new") is None  # no index yet: nothing damaged


def cache_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "cache", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cache_verify_reports_a_damaged_index_and_fix_rebuilds_it(cache_dir: Path) -> None:
    truncate(cache_dir / "index.lmdb" / "data.mdb")
    for action in (["verify"], ["stats"], ["ls"], ["clear"]):
        report = cache_cli(*action, "--cache-dir", str(cache_dir))
        assert report.returncode == 1, report
        assert report.stdout.startswith("DAMAGED index"), report.stdout
        assert "truncated" in report.stdout and "verify --fix" in report.stdout
        assert report.stderr == ""
    assert len(list((cache_dir / "kv").rglob("*.kv"))) == N_ENTRIES  # `clear` cleared nothing

    fixed = cache_cli("verify", "--fix", "--cache-dir", str(cache_dir))
    assert fixed.returncode == 0, fixed.stderr
    lines = fixed.stdout.splitlines()
    assert lines[0].startswith("index was damaged (data.mdb is")
    assert f"orphans_adopted={N_ENTRIES}" in lines[0]
    assert lines[1] == f"{N_ENTRIES} ok, 0 bad"
    assert cache_cli("verify", "--cache-dir", str(cache_dir)).stdout == f"{N_ENTRIES} ok, 0 bad\n"
