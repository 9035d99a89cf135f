"""The tier chain: every place a state of this worker can be besides a slot's live KV, and what
enters and leaves each.

    ram      the RAM tier (`backend.ramtier`, --cache-ram): live states that had to give way
    queued   snapshots taken but not yet written to their files (restorable meanwhile)
    disk     state files in the cache directory (`backend.store`), indexed by the proxy
    shared   the shared tier across hosts (`backend.shared`, --shared-tier), pulled to the disk

Which thread does what (`backend.worker.loop`):
- the compute thread holds the RAM tier and the queue: `held()` (the core's view of them),
  `state()` (a held state's bytes, to load), `give_way()`, `queue()`;
- the reader thread `read()`s a disk or shared entry: pulled (shared), read, verified (header,
  fingerprint, checksum, the prompt's token ids: `store.read_state_into`) and prepared for the
  engine (`Engine.prepare`), so the compute thread only loads it;
- the writer thread `write()`s a queued snapshot to its file (and publishes it to the shared
  tier), then reports `Saved` or `SaveFailed` to the run's stream. Where llama.cpp computes on the
  CPU it first waits for the compute thread to rest (`WRITE_REST_S` at most, and not while
  `WRITE_REST_BYTES` wait): on a few cores hashing and writing slowed every prefill it
  overlapped (bench/results/issue20).

Every change is said as a `TierEvent` to `on_event` (stored: a state of `ids` entered the tier;
removed: it left), what the proxy's view of the worker and an external KV-aware router are fed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from backend import keys, store
from backend.context import resident_bytes
from backend.protocol import Event, Fault, Job, Saved, SaveFailed, TierEvent
from backend.ramtier import RamTier
from backend.shared import STATS, SharedFault, SharedTier
from backend.worker.messages import Held, Ids
from policies.decide import Restore, Save

log = logging.getLogger("prefixgate.worker")

# the worker's memory peaks in /health's `writes`: beyond what it holds, what it holds, of it
# what was on its way (`Tiers.measure`)
PEAKS = ("peak_unheld_bytes", "peak_held_bytes", "peak_moving_bytes")


# a state file waits at most this long for the compute thread to rest (CPU compute only), and
# does not wait while this much is queued: a snapshot's memory is held until it is written
WRITE_REST_S = 10.0
WRITE_REST_BYTES = 512 << 20
SLOW_DISK_S = 3.0  # PREFIXGATE_FAULT=slow-disk: each state file read takes this much longer


@dataclass(frozen=True, slots=True)
class _Queued:
    salt: bytes
    tenant: str
    ids: Ids  # exactly the tokens its state holds
    state: memoryview
    ref: int
    twin: tuple[int, memoryview] | None = None  # the draft model's state of its first n ids

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (self.twin[1].nbytes if self.twin is not None else 0)


@dataclass(frozen=True, slots=True)
class Payload:
    """A disk or shared entry, read, verified and prepared: what `Engine.restore` loads."""

    ids: tuple[int, ...]
    state: bytes | memoryview
    padded: int
    # the file's twin: a draft model's state of its first n ids, as read (with the draft
    # engine's `spare` room after it: `Engine.restore_held` makes its form in place)
    draft: tuple[tuple[int, ...], memoryview] | None = None


@dataclass(slots=True)
class Tiers:
    cache_dir: Path
    fingerprint: bytes
    ram: RamTier
    # a read state in the form the engine loads (Engine.prepare), and the room it needs
    prepare: Callable[[Any, int], tuple[bytes | memoryview, int]]
    emit: Callable[[str, Event], None]  # to a run's stream
    on_event: Callable[[TierEvent], None] = lambda e: None
    at_rest: threading.Event | None = None  # set while the compute thread rests (CPU only)
    fault: str = ""  # a test's injected fault (PREFIXGATE_FAULT)
    spare: int = 0  # bytes of room after a read state (Engine.spare_bytes)
    # a draft model's (-md): its states' fingerprint and room, for the twins of state files
    draft_fingerprint: bytes = b""
    draft_spare: int = 0
    shared: SharedTier | None = None
    shared_stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATS, 0))
    writes: dict[str, float] = field(default_factory=lambda: {
        "queued_bytes": 0, "at_rest": 0, "rest_waited_s": 0.0,
        # a draft model's twins (backend.store): written beside the model's state, read back,
        # refused (a miss of the draft model's state alone)
        "twins_written": 0, "twins_read": 0, "twin_faults": 0})
    peaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PEAKS, 0))
    queued: dict[bytes, _Queued] = field(default_factory=dict)  # key -> a state awaiting its file
    live: dict[int, TierEvent] = field(default_factory=dict)  # slot -> what it said last
    every: bool = False  # someone reads every tier's events (live, shared): GET /events?all=1
    lock: threading.Lock = field(default_factory=threading.Lock)
    _next_ref: int = 0
    _writing: set[bytes] = field(default_factory=set)  # queued snapshots the writer has taken
    # states on their way into a tier or a slot, counted in `moving_bytes` (no tier budgets
    # them yet): a snapshot llama.cpp is copying out of a slot, a file being read, a read
    # state until the slot has loaded it and dropped it, and a written state until it is freed
    # (a weak reference to its buffer)
    _moving: int = 0
    _unfreed: list[tuple[weakref.ref[Any], int]] = field(default_factory=list)

    @contextlib.contextmanager
    def moving(self, nbytes: int) -> Iterator[None]:
        """Counts `nbytes` as a state on its way while the block runs (the snapshot it makes
        enters a tier, or is dropped, before it ends)."""
        with self.lock:
            self._moving += nbytes
        try:
            yield
        finally:
            self.measure()  # the state and what it came from, both alive and counted
            with self.lock:
                self._moving -= nbytes

    def keeps(self, state: memoryview) -> None:
        """Counts a state kept aside (a parked run's) as on its way until it is freed."""
        with self.lock:
            self._unfreed.append((weakref.ref(state.obj), state.nbytes))

    def moving_bytes(self) -> int:
        with self.lock:
            return self._moving_now()

    def _moving_now(self) -> int:
        """`moving_bytes` (under the lock)."""
        self._unfreed = [(r, n) for r, n in self._unfreed if r() is not None]
        return self._moving + sum(n for _, n in self._unfreed)

    def measure(self) -> None:
        """The peaks of the worker's memory beyond the states it holds (RSS less the RAM tier,
        the queue and the states on their way), of what it holds and of what was on its way,
        for /health (`writes`): read where the two agree, at the end of a state's way (`moving`)
        and of its write, and after a prefill step (its own figure, not a bench's sample: a
        sample falls between a state leaving the count and its memory being freed)."""
        rss = resident_bytes()
        if not rss:
            return
        with self.lock:
            moving = self._moving_now()
            held = self.ram.used + int(self.writes["queued_bytes"]) + moving
            for k, v in zip(PEAKS, (rss - held, held, moving), strict=True):
                self.peaks[k] = max(self.peaks[k], v)

    # --- the compute thread ------------------------------------------------------------------

    def held(self) -> list[Held]:
        """The RAM tier's entries and the queued snapshots, as the core sees them."""
        out = [Held("ram", k, e.salt, e.tenant, e.ids, e.size) for k, e in self.ram.entries.items()]
        with self.lock:
            out += [Held("queued", q.ref, q.salt, q.tenant, q.ids, len(q.state))
                    for q in self.queued.values()]
        return out

    def state(self, h: Held) -> tuple[Ids, memoryview] | None:
        """A held state's (ids, bytes), or None where it left its tier meanwhile."""
        if h.tier == "ram":
            e = self.ram.entries.get(h.ref)
            return None if e is None else (e.ids, e.state)
        with self.lock:
            q = next((q for q in self.queued.values() if q.ref == h.ref), None)
        return None if q is None else (q.ids, q.state)

    def taken(self, h: Held) -> None:
        """A RAM entry restored whole leaves the tier: a slot holds it live now."""
        if h.tier == "ram" and h.ref in self.ram.entries:
            self.ram.take_entry(h.ref)
            self.on_event(TierEvent("removed", "ram", h.ref, h.salt.hex(), h.tenant,
                                    len(h.ids)))

    def said_live(self, ev: TierEvent) -> None:
        """A slot's live KV as it is now (`backend.worker.live`), said where it changed."""
        said = self.live.get(ev.ref)
        if said != ev and not (said is None and ev.kind == "removed"):
            self.live[ev.ref] = ev
            self.on_event(ev)

    def draft(self, h: Held) -> tuple[Ids, memoryview] | None:
        """A RAM entry's or a queued snapshot's draft model state (ids, bytes), or None where
        it has none."""
        if h.tier == "queued":
            with self.lock:
                q = next((q for q in self.queued.values() if q.ref == h.ref), None)
            return None if q is None or q.twin is None else (q.ids[: q.twin[0]], q.twin[1])
        e = self.ram.entries.get(h.ref) if h.tier == "ram" else None
        return None if e is None or not e.draft_n else (e.ids[: e.draft_n], e.draft)

    def give_way(self, salt: bytes, tenant: str, ids: Ids, state: memoryview,
                 draft: tuple[int, memoryview] | None = None) -> None:
        """A live state that gave way enters the RAM tier (what it drops leaves it), with
        the draft model's state of its first n tokens where there is one (`draft`)."""
        key, dropped = self.ram.put(salt, tenant, ids, state, draft=draft)
        for k, e in dropped:
            self.on_event(TierEvent("removed", "ram", k, e.salt.hex(), e.tenant, len(e.ids)))
        if key is not None:
            self.on_event(TierEvent("stored", "ram", key, salt.hex(), tenant, len(ids),
                                    tuple(int(t) for t in ids)))

    def on_disk(self, key: keys.CacheKey) -> bool:
        """Its file is written already (a plan made before the proxy's index had it): the same
        key is the same bits, so it is not written again."""
        return store.state_path(self.cache_dir, key).exists()

    def queue(self, key: keys.CacheKey, salt: bytes, tenant: str, ids: Ids,
              state: memoryview, twin: tuple[int, memoryview] | None = None) -> bool:
        """A snapshot waits for its file (restorable meanwhile), with its `twin` (n, a draft
        model's state of its first n ids) where it has one; False where the same state waits
        already (a plan made before the index had it: written once)."""
        with self.lock:
            if bytes(key) in self.queued:
                return False
            self._next_ref += 1
            q = self.queued[bytes(key)] = _Queued(salt, tenant, ids, state, self._next_ref, twin)
            self.writes["queued_bytes"] += q.nbytes
        return True

    def twin_n(self, key: keys.CacheKey) -> int | None:
        """The tokens of a queued snapshot's twin (0: it has none); None where the snapshot is
        no longer queued or its file is being written (too late for another twin)."""
        with self.lock:
            q = self.queued.get(bytes(key))
            if q is None or bytes(key) in self._writing:
                return None
            return q.twin[0] if q.twin is not None else 0

    def retwin(self, key: keys.CacheKey, twin: tuple[int, memoryview]) -> bool:
        """A queued snapshot's twin replaced by a longer one (the draft model now holds more of
        its tokens), unless its file is being written or is written."""
        with self.lock:
            q = self.queued.get(bytes(key))
            if q is None or bytes(key) in self._writing:
                return False
            self.queued[bytes(key)] = new = replace(q, twin=twin)
            self.writes["queued_bytes"] += new.nbytes - q.nbytes
        return True

    # --- the reader thread -------------------------------------------------------------------

    def read(self, job: Job, r: Restore) -> tuple[Payload | None, Fault | None, Saved | None,
                                                    float]:
        """The entry pulled (shared), read, verified and prepared: (payload, fault, the pulled
        entry's `Saved`, seconds). A failure is a fault, never an exception."""
        t = time.perf_counter()
        pulled: Saved | None = None
        file = r.file
        try:
            if self.fault == "slow-disk":  # a test's injected fault: a slow disk
                time.sleep(SLOW_DISK_S)
            if r.tier == "shared":
                pulled = self._pull(r.key, r.n_tokens, job.tenant)
                file = pulled.file
            path = self.cache_dir / file
            with self.moving(_file_size(path)):
                n, state = store.read_state_into(path, self.fingerprint, job.ids, self.spare)
                with self.lock:  # counted until the slot has loaded it and let it go
                    self._unfreed.append((weakref.ref(state), state.nbytes))
            if n != r.n_tokens:
                raise store.CacheFault("tokens", f"file holds {n} tokens, index said "
                                                 f"{r.n_tokens}")
            prepared, padded = self.prepare(state, len(state) - self.spare)
            twin = self._twin(path, job, len(state) - self.spare)
            return (Payload(job.ids[:n], prepared, padded, twin), None, pulled,
                    time.perf_counter() - t)
        except store.CacheFault as e:
            if pulled is not None:  # verified: not kept locally
                self.shared_stats["verify_failures"] += 1
                with contextlib.suppress(OSError):
                    (self.cache_dir / pulled.file).unlink()
                pulled = None
            fault = Fault(e.reason, str(e), r.file or r.key.hex())
        except SharedFault as e:
            fault = Fault("missing", f"shared tier: {e}", r.key.hex())
        except ValueError as e:
            fault = Fault("corrupt", str(e), file)
        return None, fault, pulled, time.perf_counter() - t

    def _twin(self, path: Path, job: Job, model_bytes: int
              ) -> tuple[tuple[int, ...], memoryview] | None:
        """The file's twin for this worker's draft model, read and verified; None where there
        is none. A bad one is a miss of the draft model's state alone, said once a file.
        `model_bytes`: the model's state's (what the file holds besides the twin, about)."""
        if not self.draft_fingerprint:
            return None
        try:
            with self.moving(max(_file_size(path) - model_bytes, 0)):  # the twin, about
                got = store.read_twin_into(path, self.draft_fingerprint, job.ids,
                                           self.draft_spare)
                if got is not None:
                    with self.lock:  # counted until the draft model has loaded it
                        self._unfreed.append((weakref.ref(got[1]), got[1].nbytes))
        except store.CacheFault as e:
            with self.lock:
                self.writes["twin_faults"] += 1
            log.warning("worker: the draft model's state in %s not read (%s): its prompt is "
                        "prefilled", path.name, e)
            return None
        if got is None:
            return None
        n, buf = got
        with self.lock:
            self.writes["twins_read"] += 1
        return job.ids[:n], memoryview(buf)[: buf.nbytes - self.draft_spare]

    def _pull(self, key: bytes, n_tokens: int, tenant: str) -> Saved:
        """A shared entry pulled into the local tier (raises SharedFault): its `Saved` (reason
        "shared"), for the proxy to commit as a local entry."""
        if self.shared is None:
            raise SharedFault("this worker has no --shared-tier")
        t = time.perf_counter()
        path = store.state_path(self.cache_dir, keys.CacheKey(key))
        size = self.shared.pull(key, tenant, path)
        self.shared_stats["pulls"] += 1
        self.shared_stats["pulled_bytes"] += size
        self.shared_stats["pull_s"] += time.perf_counter() - t
        return Saved(n_tokens, key.hex(), "shared", str(path.relative_to(self.cache_dir)), size,
                     store.read_header(path).checksum, time.perf_counter() - t)

    # --- the writer thread -------------------------------------------------------------------

    def write(self, run_id: str, save: Save, key: keys.CacheKey, ids: tuple[int, ...],
              state: memoryview, tenant: str, queued_s: float) -> None:
        """The queued snapshot of `key` written to its file, with its twin where it has one."""
        self._await_rest(queued_s)
        t0 = time.perf_counter()
        with self.lock:
            q = self.queued.get(bytes(key))
            self._writing.add(bytes(key))  # its twin stays as it is now
        twin = q.twin if q is not None and self.draft_fingerprint else None
        try:
            path, size, checksum = store.write_state_file(
                self.cache_dir, key, self.fingerprint, ids, state,
                None if twin is None else store.Twin(self.draft_fingerprint, *twin))
        except store.CacheFault as e:
            self.emit(run_id, SaveFailed(len(ids), key.hex(), save.reason, e.reason, str(e)))
            return
        else:
            if twin is not None:
                with self.lock:
                    self.writes["twins_written"] += 1
        finally:  # written (the proxy commits it now) or failed: no longer restored from here
            self.measure()  # still queued, still alive
            with self.lock:
                gone = self.queued.pop(bytes(key), None)
                self._writing.discard(bytes(key))
                self.writes["queued_bytes"] -= gone.nbytes if gone is not None else state.nbytes
                # on its way out, counted as moving until its buffer is freed: this call's
                # caller lets it go only after it returns
                for buf in (state, *([] if twin is None else [twin[1]])):
                    with contextlib.suppress(TypeError):  # a buffer without weak references
                        self._unfreed.append((weakref.ref(buf.obj), buf.nbytes))
        self.emit(run_id, Saved(len(ids), key.hex(), save.reason,
                                str(path.relative_to(self.cache_dir)), size, checksum,
                                time.perf_counter() - t0))
        if self.shared is not None:  # after the local commit: the shared tier is the extra
            event = TierEvent("stored", "shared", int.from_bytes(bytes(key)[:8], "big"), "",
                              tenant, len(ids), tuple(int(t) for t in ids))

            def published() -> None:  # on the tier's own thread, once Redis holds it
                if self.every:
                    self.on_event(event)

            try:  # queued: the tier's own thread sends it
                self.shared.publish(key, tenant, len(ids), checksum, path, published)
            except SharedFault as e:
                self.shared_stats["publish_failures"] += 1
                log.warning("shared tier: a snapshot of %d tokens not published: %s",
                            len(ids), e)

    def _await_rest(self, queued_s: float) -> None:
        """Where `at_rest` is given (CPU compute): wait for the compute thread to rest,
        WRITE_REST_S after the state was queued at most, and not while more than
        WRITE_REST_BYTES wait."""
        if self.at_rest is None or self.writes["queued_bytes"] > WRITE_REST_BYTES:
            return
        t = time.monotonic()
        rested = self.at_rest.wait(max(queued_s + WRITE_REST_S - t, 0))
        with self.lock:
            self.writes["at_rest"] += rested
            self.writes["rest_waited_s"] += time.monotonic() - t

    def stats(self) -> dict[str, Any]:
        shared = None
        if self.shared is not None:  # the pulls are counted here, publishing by the tier
            tier = self.shared.stats()
            shared = {k: tier.get(k, 0) + self.shared_stats.get(k, 0) for k in {*tier, *STATS}}
        with self.lock:
            peaks = dict(self.peaks)
        return {"ram": self.ram.stats(), "writes": {**self.writes,
                                                     "moving_bytes": self.moving_bytes(),
                                                     **peaks},
                "shared": shared}


def _file_size(path: Path) -> int:
    """Its size; 0 where it is gone (the read then says so, as a cache fault)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
