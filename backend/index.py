"""The LMDB index of state files: cache key -> :class:`Entry`.

Rules:

- Only the proxy process writes the index; workers write state files and report them. An entry
  is put only after its file is durable (``store.write_state_file`` returned), so an entry never
  points at a partial file; :meth:`Index.reconcile` repairs the rest at startup.
- An entry stored under the key of n tokens describes a file holding KV for exactly n tokens
  (the exactness invariant). Lookups are by token ids in the proxy's radix forest
  (``proxy.cache``), which is rebuilt from this index at start; the index itself is read whole
  (``entries``, ``paths``) and written one entry at a time.
- ``cache_dir/index.lmdb`` holds two databases: ``entries`` (16-byte key -> packed Entry) and
  ``meta`` (``total_bytes``, kept in the same transaction as every entry change, so
  :meth:`Index.total_bytes` is O(1)). Entries are packed with ``struct`` (a fixed part plus
  length-prefixed strings), never pickle: the index outlives the process that wrote it.
- A full map is grown (doubled) and the write retried, transparently. Every write commits with
  one fdatasync (``metasync=False`` keeps integrity and may lose only the last commit on a system
  crash); reads take no lock beyond LMDB's reader slot.
- One lock serializes the methods of an :class:`Index`, so it may be shared by threads
  (e.g. the event loop and an executor); LMDB forbids resizing the map under an open transaction.
- A damaged index never stops a start: the index is only a summary of the state files. At open,
  LMDB's meta pages are read and checked against the file's size *before* LMDB maps it (a
  truncated ``data.mdb`` is a SIGBUS at the first touch of a missing page, which no handler can
  catch), then every database is scanned once, LMDB's damage errors caught. A damaged index is
  moved to ``index.lmdb.damaged-<UTC time>`` with one warning and a fresh one is opened;
  :meth:`Index.reconcile` then adopts the state files. :func:`find_damage` checks, changing
  nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from backend import store
from backend.index_damage import DAMAGE_ERRORS, damage_before_mapping, move_aside, scan
from backend.keys import KEY_SIZE_BYTES, CacheKey, pack_ids

log = logging.getLogger(__name__)

T = TypeVar("T")

_SCHEMA = 1
# schema, n_tokens, size_bytes, checksum, created_s, last_used_s, hits; then five
# length-prefixed (u16) byte strings: file, reason, tenant, fingerprint, prefix_of.
_FIXED = struct.Struct("<BIQQddQ")
_LEN = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_TOTAL_BYTES = b"total_bytes"
_RING_SEQ = struct.Struct(">Q")  # big-endian, so LMDB's byte order is insertion order



@dataclass(frozen=True, slots=True)
class Entry:
    n_tokens: int  # the file holds KV for exactly this many tokens
    file: str  # path of the state file relative to cache_dir, e.g. "kv/ab/ab12....kv"
    size_bytes: int  # size of the state file on disk
    checksum: int  # xxh3_64 from the file header
    reason: str  # why it was saved: cold, anchor-refresh, scoped, continued, full
    created_s: float  # wall-clock seconds (time.time()) when committed
    last_used_s: float  # wall-clock seconds of the last hit (or created_s)
    hits: int  # restores served from this entry
    fingerprint: bytes  # model/config fingerprint (keys.fingerprint), 16 bytes
    tenant: str  # "" when tenant isolation is off
    prefix_of: bytes = b""  # key of the stored entry this one extends (its stored prefix), or b""


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    temp_files_removed: int  # ".tmp-*" leftovers of interrupted writes
    missing_dropped: int  # entries whose file was gone
    size_dropped: int  # entries whose file size differed (file removed too)
    unreadable_dropped: int  # entries whose value could not be decoded
    orphans_removed: int  # .kv files no entry pointed to, and not adoptable
    kept: int  # entries left (adopted ones included)
    orphans_adopted: int = 0  # complete .kv files no entry pointed to, recorded now


@dataclass(slots=True)
class _Checked:
    """What reconcile found in the index (mutable while one write transaction runs)."""

    missing: int = 0
    unreadable: int = 0
    wrong_size_files: list[str] = field(default_factory=list)
    referenced: set[Path] = field(default_factory=set)


class Index:
    """Key -> Entry over LMDB in ``cache_dir/index.lmdb``."""

    def __init__(self, cache_dir: Path, map_size_bytes: int = 64 << 20) -> None:
        self.cache_dir = Path(cache_dir)
        self.path = self.cache_dir / "index.lmdb"
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.damaged: Path | None = None  # where a damaged index was moved at open, if one was
        why = damage_before_mapping(self.path / "data.mdb")
        if why is None:
            try:
                self._open(map_size_bytes)
                return
            except DAMAGE_ERRORS as e:
                if hasattr(self, "_env"):  # opened, then a read failed
                    self._env.close()
                why = f"LMDB: {e}"
        self.damaged = move_aside(self.path, why)
        self.path.mkdir()
        self._open(map_size_bytes)

    def _open(self, map_size_bytes: int) -> None:
        self._env = lmdb.open(
            str(self.path), subdir=True, map_size=map_size_bytes, max_dbs=4, metasync=False
        )
        self._entries = self._env.open_db(b"entries")
        self._meta = self._env.open_db(b"meta")
        self._ring = self._env.open_db(b"ring")
        self._paths = self._env.open_db(b"paths")
        with self._env.begin() as txn:
            scan(txn, (self._entries, self._meta, self._ring, self._paths))

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._env.close()

    # --- reads (the hot path: one `lookup` per request, off the event loop) -----------------

    def entries(self) -> list[tuple[CacheKey, Entry]]:
        def scan(txn: lmdb.Transaction) -> list[tuple[CacheKey, Entry]]:
            out = []
            for raw_key, value in txn.cursor(db=self._entries):
                entry = _decode_or_log(raw_key, value)
                if entry is not None:
                    out.append((CacheKey(bytes(raw_key)), entry))
            return out

        return self._read(scan)

    def total_bytes(self) -> int:
        return self._read(self._total)

    def __len__(self) -> int:
        return self._read(lambda txn: int(txn.stat(self._entries)["entries"]))

    # --- writes (the proxy, after a worker reported the file durable) ----------------------

    def put(self, key: CacheKey, entry: Entry, tail: Sequence[int] | None = None) -> None:
        """Store the entry; `tail`: its token ids past `entry.prefix_of`'s (see `paths`)."""
        value = _encode(entry)
        if len(key) != KEY_SIZE_BYTES:
            raise ValueError(f"cache key must be {KEY_SIZE_BYTES} bytes, got {len(key)}")
        if Path(entry.file).is_absolute():
            raise ValueError(f"entry file must be relative to cache_dir, got {entry.file}")

        def put(txn: lmdb.Transaction) -> None:
            old = txn.get(key, db=self._entries)
            total = self._total(txn) - (_size_of(old) if old is not None else 0)
            txn.put(key, value, db=self._entries)
            self._set_total(txn, total + entry.size_bytes)
            if tail is not None:
                txn.put(key, pack_ids(tail), db=self._paths)

        self._write(put)

    def relink(self, key: CacheKey, prefix_of: bytes, tail: Sequence[int]) -> None:
        """The entry now extends `prefix_of` (its old parent was deleted) by `tail`."""

        def relink(txn: lmdb.Transaction) -> None:
            entry = self._get(txn, key)
            if entry is not None:
                txn.put(key, _encode(dataclasses.replace(entry, prefix_of=prefix_of)),
                        db=self._entries)
                txn.put(key, pack_ids(tail), db=self._paths)

        self._write(relink)

    def paths(self) -> dict[CacheKey, tuple[int, ...]]:
        """Each entry's token ids past its `prefix_of` entry's end (all of them when it extends
        none): with `prefix_of`, every entry's ids, so the radix tree is rebuilt from here."""

        def scan(txn: lmdb.Transaction) -> dict[CacheKey, tuple[int, ...]]:
            return {CacheKey(bytes(k)): _unpack_ids(v) for k, v in txn.cursor(db=self._paths)}

        return self._read(scan)

    def touch(self, key: CacheKey, now_s: float) -> None:
        """Count a hit: hits += 1, last_used_s = now_s. A key evicted meanwhile is ignored."""

        def touch(txn: lmdb.Transaction) -> None:
            entry = self._get(txn, key)
            if entry is not None:
                hit = dataclasses.replace(entry, hits=entry.hits + 1, last_used_s=now_s)
                txn.put(key, _encode(hit), db=self._entries)

        self._write(touch)

    def delete(self, key: CacheKey) -> Entry | None:
        """Remove the entry and unlink its file (an already missing file is fine)."""

        def pop(txn: lmdb.Transaction) -> Entry | None:
            value = txn.pop(key, db=self._entries)
            txn.delete(key, db=self._paths)
            if value is None:
                return None
            self._set_total(txn, self._total(txn) - _size_of(value))
            return _decode_or_log(key, value)

        entry = self._write(pop)
        if entry is not None:
            self._unlink(entry.file)
        return entry

    def clear(self) -> int:
        """Remove every entry and its file; return how many entries there were."""

        def drop_all(txn: lmdb.Transaction) -> tuple[int, list[str]]:
            n = int(txn.stat(self._entries)["entries"])
            files = [e.file for k, v in txn.cursor(db=self._entries) if (e := _decode_or_log(k, v))]
            txn.drop(self._entries, delete=False)
            txn.drop(self._paths, delete=False)
            self._set_total(txn, 0)
            return n, files

        n, files = self._write(drop_all)
        self._write(lambda txn: txn.drop(self._ring, delete=False))
        for file in files:
            self._unlink(file)
        return n

    def reconcile(self) -> ReconcileReport:
        """Startup repair, before any worker writes: sweep temp files, then make the index and
        the .kv files agree. Entries without their file, or with the wrong size, are dropped. A
        file without an entry (its proxy was killed between the worker's rename and the commit)
        is adopted when its name is a key and its header is complete, as reason ``adopted``
        (tenant unknown); otherwise it is deleted. Checksums are not read here: a restore
        verifies the whole file before it is trusted."""
        kv_dir = self.cache_dir / "kv"
        temps = sorted(kv_dir.rglob(".tmp-*")) if kv_dir.is_dir() else []
        for tmp in temps:
            self._unlink(tmp)
        checked = self._write(self._drop_broken)
        for file in checked.wrong_size_files:
            self._unlink(file)
        kv_files = sorted(kv_dir.rglob("*.kv")) if kv_dir.is_dir() else []
        orphans = [p for p in kv_files if p not in checked.referenced]
        adopted = 0
        for orphan in orphans:
            found = self._adoptable(orphan)
            if found is None:
                self._unlink(orphan)
            else:
                self.put(*found)
                adopted += 1
        report = ReconcileReport(
            temp_files_removed=len(temps),
            missing_dropped=checked.missing,
            size_dropped=len(checked.wrong_size_files),
            unreadable_dropped=checked.unreadable,
            orphans_removed=len(orphans) - adopted,
            kept=len(checked.referenced) + adopted,
            orphans_adopted=adopted,
        )
        log.info("cache reconcile: %s", report)
        return report

    def _adoptable(self, path: Path) -> tuple[CacheKey, Entry] | None:
        """(key, entry) for an orphan state file named after its key with a complete header."""
        try:
            key = CacheKey(bytes.fromhex(path.stem))
            header = store.read_header(path, complete=True)
        except (ValueError, OSError, store.CacheFault):
            return None
        if len(key) != KEY_SIZE_BYTES or store.state_path(self.cache_dir, key) != path:
            return None
        mtime = path.stat().st_mtime
        return key, Entry(
            n_tokens=header.n_tokens, file=str(path.relative_to(self.cache_dir)),
            size_bytes=header.file_size_bytes, checksum=header.checksum, reason="adopted",
            created_s=mtime, last_used_s=mtime, hits=0, fingerprint=header.fingerprint,
            tenant="")

    def _drop_broken(self, txn: lmdb.Transaction) -> _Checked:
        """Drop entries whose file is missing, of the wrong size, or whose value is unreadable;
        recount total_bytes from what is left."""
        checked = _Checked()
        drop: list[bytes] = []
        total = 0
        for raw_key, value in txn.cursor(db=self._entries):
            key = bytes(raw_key)
            entry = _decode_or_log(key, value)
            if entry is None:
                checked.unreadable += 1
                drop.append(key)
                continue
            path = self.cache_dir / entry.file
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                log.info("index entry %s: file %s is gone; dropped", key.hex(), entry.file)
                checked.missing += 1
                drop.append(key)
                continue
            if size != entry.size_bytes:
                log.info(
                    "index entry %s: file %s is %d bytes, expected %d; dropped",
                    key.hex(),
                    entry.file,
                    size,
                    entry.size_bytes,
                )
                checked.wrong_size_files.append(entry.file)
                drop.append(key)
                continue
            checked.referenced.add(path)
            total += entry.size_bytes
        for key in drop:
            txn.delete(key, db=self._entries)
            txn.delete(key, db=self._paths)
        self._set_total(txn, total)
        return checked

    # --- the recent-prompt ring, persisted so that `auto` survives a restart ----------------

    def ring_push(self, tenant: str, ids: Sequence[int], capacity: int) -> None:
        """Append a prompt (its tenant id and token ids); keep only the newest `capacity`."""
        t = tenant.encode()
        value = _LEN.pack(len(t)) + t + pack_ids(ids)

        def push(txn: lmdb.Transaction) -> None:
            cur = txn.cursor(db=self._ring)
            seq = _RING_SEQ.unpack(cur.key())[0] + 1 if cur.last() else 0
            txn.put(_RING_SEQ.pack(seq), value, db=self._ring)
            excess = int(txn.stat(self._ring)["entries"]) - capacity
            if excess > 0 and cur.first():
                for _ in range(excess):
                    cur.delete()

        self._write(push)

    def ring_load(self) -> list[tuple[str, tuple[int, ...]]]:
        """The persisted prompts, oldest first."""

        def scan(txn: lmdb.Transaction) -> list[tuple[str, tuple[int, ...]]]:
            out = []
            for _, value in txn.cursor(db=self._ring):
                (n,) = _LEN.unpack_from(value)
                out.append((bytes(value[_LEN.size:_LEN.size + n]).decode(),
                            _unpack_ids(value[_LEN.size + n:])))
            return out

        return self._read(scan)

    # --- plumbing --------------------------------------------------------------------------

    def _read(self, fn: Callable[[Any], T]) -> T:
        with self._lock:
            while True:
                try:
                    with self._env.begin() as txn:
                        return fn(txn)
                except lmdb.MapResizedError:
                    self._env.set_mapsize(0)  # another process grew the map: adopt its size

    def _write(self, fn: Callable[[Any], T]) -> T:
        with self._lock:
            while True:
                try:
                    with self._env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    map_size = int(self._env.info()["map_size"]) * 2
                    log.info("index map full; growing it to %d bytes", map_size)
                    self._env.set_mapsize(map_size)
                except lmdb.MapResizedError:
                    self._env.set_mapsize(0)

    def _get(self, txn: Any, key: bytes) -> Entry | None:
        value = txn.get(key, db=self._entries)
        return None if value is None else _decode_or_log(key, value)

    def _total(self, txn: Any) -> int:
        value = txn.get(_TOTAL_BYTES, db=self._meta)
        return 0 if value is None else int(_U64.unpack(value)[0])

    def _set_total(self, txn: Any, total_bytes: int) -> None:
        assert total_bytes >= 0, total_bytes
        txn.put(_TOTAL_BYTES, _U64.pack(total_bytes), db=self._meta)

    def _unlink(self, file: str | Path) -> None:
        try:
            (self.cache_dir / file).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove state file %s: %s", file, e)


def _unpack_ids(raw: bytes | memoryview) -> tuple[int, ...]:
    ids = array("i")
    ids.frombytes(bytes(raw))
    if sys.byteorder == "big":
        ids.byteswap()
    return tuple(ids)


def _encode(entry: Entry) -> bytes:
    parts = [
        _FIXED.pack(
            _SCHEMA,
            entry.n_tokens,
            entry.size_bytes,
            entry.checksum,
            entry.created_s,
            entry.last_used_s,
            entry.hits,
        )
    ]
    for part in (
        entry.file.encode(),
        entry.reason.encode(),
        entry.tenant.encode(),
        entry.fingerprint,
        entry.prefix_of,
    ):
        parts += (_LEN.pack(len(part)), part)
    return b"".join(parts)


def _decode(value: bytes | memoryview) -> Entry:
    schema, n_tokens, size_bytes, checksum, created_s, last_used_s, hits = _FIXED.unpack_from(value)
    if schema != _SCHEMA:
        raise ValueError(f"entry schema {schema}, expected {_SCHEMA}")
    fields: list[bytes] = []
    at = _FIXED.size
    for _ in range(5):
        (n,) = _LEN.unpack_from(value, at)
        fields.append(bytes(value[at + _LEN.size : at + _LEN.size + n]))
        at += _LEN.size + n
    if at != len(value):
        raise ValueError(f"entry is {len(value)} bytes, fields end at {at}")
    file, reason, tenant, fp, prefix_of = fields
    return Entry(
        n_tokens=n_tokens,
        file=file.decode(),
        size_bytes=size_bytes,
        checksum=checksum,
        reason=reason.decode(),
        created_s=created_s,
        last_used_s=last_used_s,
        hits=hits,
        fingerprint=fp,
        tenant=tenant.decode(),
        prefix_of=prefix_of,
    )


def _decode_or_log(key: bytes | memoryview, value: bytes | memoryview) -> Entry | None:
    try:
        return _decode(value)
    except (struct.error, ValueError) as e:  # UnicodeDecodeError is a ValueError
        log.warning("unreadable index entry %s: %s", bytes(key).hex(), e)
        return None


def _size_of(value: bytes | memoryview) -> int:
    """size_bytes of a packed entry, 0 if it is unreadable (it counted 0 when it was put)."""
    try:
        return int(_FIXED.unpack_from(value)[2])
    except struct.error:
        return 0
