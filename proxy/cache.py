"""The proxy's side of the disk cache: the one owner of the LMDB index, kept off the event loop.

    lookup(facts, tenant) -> Stored   every stored prefix of the prompt, by its token ids (the
                                      radix forest, in memory): the longest few, and all positions
    commit(saved, tenant, ids)        record a state file the worker reported durable, then evict
    touch(key, now_s), drop(key)      a hit served; a broken entry removed (its file too)
    ring_push / ring_load             the recent-prompt ring, persisted so `auto` survives restarts

Rules:
- Every method here blocks: the gateway and the run driver call them through `read` (any thread)
  and `write` (one dedicated thread, so writes land in order and the in-memory state below has one
  writer). The radix forest and the entry mirror change together under one lock, which a lookup
  takes too: a lookup never sees a key in a tree before its entry is in the mirror (a KeyError
  there was a 500), nor a tree halfway through an insert.
- An entry is committed only after its file is durable (the worker says so), never before.
- Lookup is by token ids: a radix tree per tenant (`policies.radix`) over the entries of this
  model and configuration (their fingerprint); entries of another fingerprint stay in the index
  for when that model comes back, but are never found. The index is the truth: each entry
  persists its parent (`prefix_of`, the longest stored entry it extends) and its ids past it, so
  the trees are rebuilt at start (from a state file's header for an entry without that record).
  Inserting or deleting an entry between others relinks its children.
- Eviction reads no LMDB: a mirror of every entry (loaded once at start, kept in step with every
  put, touch, relink and delete) gives the total bytes in O(1) and the eviction views when the
  budget is exceeded; `policies.eviction.evict_until` orders them. The entry just written is
  protected. An entry that a newer one extends is weighted down when it is a superseded
  checkpoint or turn end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from backend import keys, store
from backend.index import Entry, Index
from backend.protocol import Saved
from policies.decide import RESTORE_CANDIDATES, Facts, Hit, Stored
from policies.eviction import EntryView, evict_until
from policies.plan import CacheKnobs
from policies.radix import Forest, RadixTree
from proxy.metrics import Metrics

log = logging.getLogger("prefixgate")

T = TypeVar("T")

SALTS_KEPT = 1024  # tenants whose cache salt is remembered (least recently used forgotten)


class DiskCache:
    def __init__(self, index: Index, identity: keys.CacheIdentity, knobs: CacheKnobs,
                 budget_bytes: int, metrics: Metrics) -> None:
        self.index = index
        self.identity = identity
        self.knobs = knobs
        self.budget_bytes = budget_bytes
        self.metrics = metrics
        # tenant -> salt, the most recently used last: bounded (a client may send a new random
        # key with every request); a salt is cheap to make again once the model file was hashed
        self._salts: OrderedDict[str, bytes] = OrderedDict()
        self._salts_lock = threading.Lock()  # `salt` runs on any thread
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="lmdb-writer")
        self._entries: dict[bytes, Entry] = {}  # the mirror (see the module rules)
        self._extended: Counter[bytes] = Counter()  # key -> entries whose prefix_of it is
        self._total_bytes = 0
        self._forest = Forest()  # this fingerprint's entries, by tenant and token ids
        # held while the forest and the mirror change (the writer) and while a lookup reads them
        self._lock = threading.RLock()
        # an entry of this model committed ("stored", its ids) or deleted ("removed"): the
        # host's KV events (proxy/kv_events.py); called on the writer thread, under the lock
        self.on_event: Callable[[str, bytes, Sequence[int]], None] | None = None

    # --- running blocking work off the loop ------------------------------------------------

    async def read(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.to_thread(fn, *args)

    async def write(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    # --- blocking --------------------------------------------------------------------------

    def load(self) -> None:
        """At start, before any worker writes: reconcile the index with the files, fill the
        mirror, rebuild the radix trees, and evict down to the budget."""
        report = self.index.reconcile()
        with self._lock:
            for key, entry in self.index.entries():
                self._remember(key, entry)
            self._rebuild(self.index.paths())
        log.info("cache %s: %d entries (%d of this model), %d bytes; reconcile: %s",
                 self.index.cache_dir, len(self._entries), len(self._forest),
                 self._total_bytes, report)
        self.metrics.cache_budget_bytes.set(self.budget_bytes)
        self.evict()

    def _rebuild(self, paths: Mapping[bytes, tuple[int, ...]]) -> None:
        """Every entry of this fingerprint into its tenant's tree, parents first (a parent is
        shorter than its child); an entry without a usable path record is read from its file's
        header and its record written."""
        ids_of: dict[bytes, tuple[int, ...]] = {}
        mine = sorted(((e.n_tokens, k) for k, e in self._entries.items()
                       if e.fingerprint == self.fingerprint))
        for _, key in mine:
            e = self._entries[key]
            tail = paths.get(key)
            ids: tuple[int, ...] | None = None
            if tail is not None and (not e.prefix_of or e.prefix_of in ids_of):
                ids = ids_of.get(e.prefix_of, ()) + tail
            if ids is None or len(ids) != e.n_tokens:
                try:
                    ids = store.read_ids(self.index.cache_dir / e.file)
                except store.CacheFault as fault:
                    log.warning("cache entry %s dropped: %s", key.hex(), fault)
                    self._delete(key)
                    continue
                tail = None  # its record is (re)written below
            ids_of[key] = ids
            self._forest.tree(e.tenant).insert(ids, key)
            if tail is None:
                self._link(key)

    @functools.cached_property
    def fingerprint(self) -> bytes:
        return keys.fingerprint(self.salt(""))

    def salt(self, tenant: str) -> bytes:
        with self._salts_lock:
            salt = self._salts.get(tenant)
            if salt is not None:
                self._salts.move_to_end(tenant)
                return salt
        salt = self.identity.salt(tenant)
        with self._salts_lock:
            self._salts[tenant] = salt
            while len(self._salts) > SALTS_KEPT:
                self._salts.popitem(last=False)
        return salt

    def lookup(self, facts: Facts, tenant: str) -> Stored:
        with self._lock:
            found = self._forest.match(tenant, facts.ids)
            return Stored(hits=tuple(Hit(n, k, self._entries[k].file,
                                         self._entries[k].size_bytes)
                                     for n, k in found[:RESTORE_CANDIDATES]),
                          positions=frozenset(n for n, _ in found))

    def commit(self, saved: Saved, tenant: str, ids: Sequence[int]) -> None:
        """Record a durable state file of the first `saved.n_tokens` of `ids` (on the writer
        thread)."""
        with self._lock:
            self._commit(saved, tenant, ids)

    def _commit(self, saved: Saved, tenant: str, ids: Sequence[int]) -> None:
        now = time.time()
        key = keys.CacheKey(bytes.fromhex(saved.key))
        self._delete(key, unlink=False)  # the same key again: the file was just rewritten
        tree = self._forest.tree(tenant)
        tree.insert(ids[: saved.n_tokens], key)
        if self.on_event is not None:
            self.on_event("stored", key, ids[: saved.n_tokens])
        self._remember(key, Entry(n_tokens=saved.n_tokens, file=saved.file,
                                  size_bytes=saved.size_bytes, checksum=saved.checksum,
                                  reason=saved.reason, created_s=now, last_used_s=now, hits=0,
                                  fingerprint=self.fingerprint, tenant=tenant))
        self._link(key, put=True)
        for _, child in tree.children_of(key):  # it sits between a parent and these now
            self._link(child)
        self._evict(protect=key)

    def touch(self, key: bytes, now_s: float) -> None:
        self.index.touch(keys.CacheKey(key), now_s)
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self._entries[key] = dataclasses.replace(e, hits=e.hits + 1, last_used_s=now_s)

    def drop(self, key: bytes) -> None:
        with self._lock:
            self._delete(key)
            self._set_gauges()

    def ring_push(self, tenant: str, ids: Sequence[int], capacity: int) -> None:
        self.index.ring_push(tenant, ids, capacity)

    def ring_load(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.index.ring_load()

    def evict(self, protect: bytes | None = None) -> None:
        with self._lock:
            self._evict(protect)

    def _evict(self, protect: bytes | None) -> None:
        if self._total_bytes > self.budget_bytes:
            views = [EntryView(k, e.n_tokens, e.size_bytes, e.reason, e.created_s,
                               e.last_used_s, e.hits, self._extended[k] > 0)
                     for k, e in self._entries.items()]
            for k in evict_until(views, self.budget_bytes, time.time(),
                                 protect=[protect] if protect else []):
                gone = self._delete(k)
                if gone is not None:
                    self.metrics.evictions.inc()
                    self.metrics.evicted_bytes.inc(gone.size_bytes)
        self._set_gauges()

    def held(self) -> list[tuple[bytes, tuple[int, ...]]]:
        """Every entry of this model as (key, ids): what the disk holds."""
        with self._lock:
            return [(k, tuple(self._forest.tree(e.tenant).ids_of(k)))
                    for k, e in self._entries.items() if self._tree_of(k) is not None]

    # --- the trees, the index and the mirror in step ------------------------------------

    def _tree_of(self, key: bytes) -> RadixTree | None:
        e = self._entries.get(key)
        if e is None or e.fingerprint != self.fingerprint:
            return None
        tree = self._forest.tree(e.tenant)
        return tree if key in tree else None

    def _link(self, key: bytes, put: bool = False) -> None:
        """Persist `key`'s parent and its ids past the parent, as its tree has them now."""
        tree = self._tree_of(key)
        if tree is None:
            return
        parent = tree.parent_of(key)
        start, prefix_of = parent if parent is not None else (0, b"")
        tail = tree.ids_of(key)[start:]
        entry = dataclasses.replace(self._entries[key], prefix_of=prefix_of)
        self._forget(key)
        self._remember(key, entry)
        if put:
            self.index.put(keys.CacheKey(key), entry, tail)
        else:
            self.index.relink(keys.CacheKey(key), prefix_of, tail)

    def _delete(self, key: bytes, unlink: bool = True) -> Entry | None:
        """Remove an entry everywhere (its file too unless `unlink` is False); its children
        are relinked to its parent."""
        tree = self._tree_of(key)
        children = tree.children_of(key) if tree is not None else []
        if tree is not None:
            tree.delete(key)
            if self.on_event is not None:
                self.on_event("removed", key, ())
        gone = self.index.delete(keys.CacheKey(key)) if unlink else None
        self._forget(key)
        for _, child in children:
            self._link(child)
        return gone

    # --- the mirror ------------------------------------------------------------------------

    def _remember(self, key: bytes, entry: Entry) -> None:
        self._entries[key] = entry
        self._total_bytes += entry.size_bytes
        if entry.prefix_of:
            self._extended[entry.prefix_of] += 1

    def _forget(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._total_bytes -= entry.size_bytes
        if entry.prefix_of:
            self._extended[entry.prefix_of] -= 1
            if self._extended[entry.prefix_of] <= 0:
                del self._extended[entry.prefix_of]

    def _set_gauges(self) -> None:
        self.metrics.cache_bytes.set(self._total_bytes)
        self.metrics.cache_entries.set(len(self._entries))

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def __len__(self) -> int:
        return len(self._entries)
