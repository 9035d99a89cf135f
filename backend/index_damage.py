"""A damaged cache index: found before LMDB maps it (its meta pages read as bytes), or by a read
that meets a damaged page; moved aside so a fresh index is rebuilt from the state files
(backend/index.py), or reported without a change (`prefixgate cache verify`).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb

log = logging.getLogger("backend.index")  # the index's own log, as before the split

# LMDB's meta page as the C library writes it (mdb.c; native sizes and alignment): the page
# header (pgno, pad, flags, lower, upper), then MDB_meta: magic, version, address, mapsize, two
# MDB_db (FREE_DBI, MAIN_DBI: pad (FREE_DBI's holds the page size), flags, depth, branch, leaf
# and overflow pages, entries, root), last_pg, txnid.
_LMDB_META = struct.Struct("@NHHHH" + "IIPN" + "IHHNNNNN" * 2 + "NN")
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_DATA_VERSION = 1
_LMDB_P_META = 0x08
_LMDB_P_INVALID = (1 << (8 * struct.calcsize("N"))) - 1  # the root of an empty database
# LMDB's errors that mean a damaged file (not a full disk, a permission, too many readers)
# (MDB_BAD_TXN: a read that met a damaged page poisoned its transaction)
DAMAGE_ERRORS = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError,
                 lmdb.VersionMismatchError, lmdb.IncompatibleError, lmdb.BadValsizeError,
                 lmdb.BadTxnError)


def find_damage(cache_dir: Path) -> str | None:
    """Why ``cache_dir``'s index is damaged, or None; changes nothing (``cache verify``)."""
    path = Path(cache_dir) / "index.lmdb"
    why = damage_before_mapping(path / "data.mdb")
    if why is not None or not (path / "data.mdb").is_file():
        return why
    try:
        env = lmdb.open(str(path), subdir=True, readonly=True, max_dbs=8)
    except DAMAGE_ERRORS as e:
        return f"LMDB: {e}"
    try:
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]  # the named databases
            scan(txn, [env.open_db(n, txn=txn, create=False) for n in names])
    except DAMAGE_ERRORS as e:
        return f"LMDB: {e}"
    finally:
        env.close()
    return None


def scan(txn: lmdb.Transaction, dbs: Sequence[Any]) -> None:
    """Read every record of ``dbs`` once: LMDB reports a damaged page it meets as an error."""
    for db in dbs:
        for _ in txn.cursor(db=db):
            pass


def damage_before_mapping(data: Path) -> str | None:
    """What is wrong with LMDB's meta pages in ``data`` (read, not mapped), or None. A missing
    or empty file is fine: LMDB initializes it."""
    try:
        with data.open("rb") as f:
            size_bytes = os.fstat(f.fileno()).st_size
            if size_bytes == 0:
                return None
            first = f.read(_LMDB_META.size)
            if len(first) < _LMDB_META.size:
                return f"data.mdb is {size_bytes} bytes, shorter than a meta page"
            page_bytes = _LMDB_META.unpack(first)[9]
            if page_bytes < 512 or page_bytes > 1 << 16 or page_bytes & (page_bytes - 1):
                return f"meta page 0 gives a page size of {page_bytes} bytes"
            f.seek(page_bytes)
            second = f.read(_LMDB_META.size)
    except FileNotFoundError:
        return None
    if len(second) < _LMDB_META.size:
        return f"data.mdb is {size_bytes} bytes, shorter than its two meta pages"
    metas = [_LMDB_META.unpack(first), _LMDB_META.unpack(second)]
    for k, m in enumerate(metas):
        if not m[2] & _LMDB_P_META or m[5] != _LMDB_MAGIC or m[6] != _LMDB_DATA_VERSION:
            return (f"meta page {k} is not an LMDB meta page (flags {m[2]:#x}, magic {m[5]:#x}, "
                    f"version {m[6]})")
    newest = metas[1] if metas[1][26] > metas[0][26] else metas[0]  # as LMDB chooses
    last_page, roots = newest[25], (newest[16], newest[24])
    if size_bytes < (last_page + 1) * page_bytes:
        return (f"data.mdb is {size_bytes} bytes, its meta page says "
                f"{(last_page + 1) * page_bytes} (truncated)")
    if any(r != _LMDB_P_INVALID and not 2 <= r <= last_page for r in roots):
        return f"a database root is outside pages 2..{last_page}: {roots}"
    return None


def move_aside(path: Path, why: str) -> Path:
    """Rename the damaged index directory to ``<name>.damaged-<UTC time>`` (kept for a look)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
        n += 1
    path.rename(aside)
    log.warning("cache index %s is damaged (%s): moved to %s; a fresh index is rebuilt from the "
                "state files", path, why, aside.name)
    return aside
