"""The proxy's side of the disk cache: the one owner of the LMDB index, kept off the event loop.

    lookup(facts, tenant) -> Stored   candidate positions and their keys, then one read
                                      transaction: the stored entries (longest first, the hit and
                                      its fallbacks) and the set of stored positions
    commit(saved, tenant, keys)       record a state file the worker reported durable, then evict
    touch(key, now_s), drop(key)      a hit served; a broken entry removed (its file too)
    ring_push / ring_load             the recent-prompt ring, persisted so `auto` survives restarts

Rules:
- Every method here blocks: the gateway and the run driver call them through `read` (any thread)
  and `write` (one dedicated thread, so writes land in order and the mirror below has one writer).
- An entry is committed only after its file is durable (the worker says so), never before.
- Eviction reads no LMDB: a mirror of every entry (loaded once at start, kept in step with every
  put, touch and delete) gives the total bytes in O(1) and the eviction views when the budget is
  exceeded; `policies.eviction.evict_until` orders them. The entry just written is protected.
- A commit records which stored entry the new one extends (`prefix_of`): eviction weights a
  superseded checkpoint or turn end down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from backend import keys
from backend.index import Entry, Index
from backend.protocol import Saved
from policies.decide import RESTORE_CANDIDATES, Facts, Hit, Stored
from policies.eviction import EntryView, evict_until
from policies.plan import CacheKnobs, candidate_positions
from proxy.metrics import Metrics

log = logging.getLogger("prefixgate")

T = TypeVar("T")


class DiskCache:
    def __init__(self, index: Index, identity: keys.CacheIdentity, knobs: CacheKnobs,
                 budget_bytes: int, metrics: Metrics) -> None:
        self.index = index
        self.identity = identity
        self.knobs = knobs
        self.budget_bytes = budget_bytes
        self.metrics = metrics
        self._salts: dict[str, bytes] = {}  # tenant -> salt (reads the model file once)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="lmdb-writer")
        self._entries: dict[bytes, Entry] = {}  # the mirror (see the module rules)
        self._extended: Counter[bytes] = Counter()  # key -> entries whose prefix_of it is
        self._total_bytes = 0

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
        mirror, and evict down to the budget."""
        report = self.index.reconcile()
        for key, entry in self.index.entries():
            self._remember(key, entry)
        log.info("cache %s: %d entries, %d bytes; reconcile: %s", self.index.cache_dir,
                 len(self._entries), self._total_bytes, report)
        self.metrics.cache_budget_bytes.set(self.budget_bytes)
        self.evict()

    @functools.cached_property
    def fingerprint(self) -> bytes:
        return keys.fingerprint(self.salt(""))

    def salt(self, tenant: str) -> bytes:
        if tenant not in self._salts:
            self._salts[tenant] = self.identity.salt(tenant)
        return self._salts[tenant]

    def lookup(self, facts: Facts, tenant: str) -> Stored:
        positions = candidate_positions(len(facts.ids), facts.boundaries, facts.scope,
                                        self.knobs)
        keyed = keys.prefix_keys(self.salt(tenant), facts.ids, positions)
        hits, stored = self.index.lookup(keyed, RESTORE_CANDIDATES)
        return Stored(keys=keyed, hits=tuple(Hit(n, k, e.file) for n, k, e in hits),
                      positions=frozenset(stored))

    def commit(self, saved: Saved, tenant: str, keyed: Mapping[int, bytes]) -> None:
        """Record a durable state file (on the writer thread)."""
        now = time.time()
        key = keys.CacheKey(bytes.fromhex(saved.key))
        n = saved.n_tokens
        # the longest stored entry this one extends: eviction weights contained entries down
        below = [p for p in keyed if p < n and keyed[p] in self._entries]
        prefix_of = keyed[max(below)] if below else b""
        entry = Entry(n_tokens=n, file=saved.file, size_bytes=saved.size_bytes,
                      checksum=saved.checksum, reason=saved.reason, created_s=now,
                      last_used_s=now, hits=0, fingerprint=self.fingerprint, tenant=tenant,
                      prefix_of=prefix_of)
        self.index.put(key, entry)
        self._forget(key)
        self._remember(key, entry)
        self.evict(protect=key)

    def touch(self, key: bytes, now_s: float) -> None:
        self.index.touch(keys.CacheKey(key), now_s)
        e = self._entries.get(key)
        if e is not None:
            self._entries[key] = dataclasses.replace(e, hits=e.hits + 1, last_used_s=now_s)

    def drop(self, key: bytes) -> None:
        self.index.delete(keys.CacheKey(key))
        self._forget(key)
        self._set_gauges()

    def ring_push(self, tenant: str, ids: Sequence[int], capacity: int) -> None:
        self.index.ring_push(tenant, ids, capacity)

    def ring_load(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.index.ring_load()

    def evict(self, protect: bytes | None = None) -> None:
        if self._total_bytes > self.budget_bytes:
            views = [EntryView(k, e.n_tokens, e.size_bytes, e.reason, e.created_s,
                               e.last_used_s, e.hits, self._extended[k] > 0)
                     for k, e in self._entries.items()]
            for k in evict_until(views, self.budget_bytes, time.time(),
                                 protect=[protect] if protect else []):
                gone = self.index.delete(keys.CacheKey(k))
                self._forget(k)
                if gone is not None:
                    self.metrics.evictions.inc()
                    self.metrics.evicted_bytes.inc(gone.size_bytes)
        self._set_gauges()

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
