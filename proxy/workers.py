"""Worker supervision and the pool the gateway draws workers from (one worker's link, its
slots and the checks it must pass to join: proxy/worker_link.py).

Two kinds of worker behind the same HTTP API (backend/worker.py):

- **local** (`--workers N`): processes spawned here, each on a Unix socket. One that exits is
  restarted; requests wait for it meanwhile (it comes back by itself).
- **remote** (`--worker-url URL`, repeatable; replaces `--workers`): a `prefixgate worker
  --listen HOST:PORT` in another process or container, sharing the cache directory (a volume).
  The proxy neither starts nor stops it; it probes it.

Rules:

- At startup every worker must answer `/health` in the proxy's worker protocol (a worker of
  another version is refused, and kept out if it turns into one later) with the proxy's
  fingerprint (same model file,
  n_ctx, KV types, flash-attn, llama-cpp-python version, and the devices that compute: the
  first worker says them, every other must compute on the same) and, when remote with the
  disk cache on, report the proxy's cache volume id (backend/volume.py). Otherwise the proxy
  refuses to start with a `StartupError` that says what differs. A remote worker is waited for
  up to `REMOTE_WAIT_S` (it may still be loading its model).
- A remote worker is probed every `PROBE_INTERVAL_S`. Refused or reset: down at once. Timed out:
  down after `PROBE_TIMEOUTS_DOWN` in a row (a loaded machine is slow, not dead). Down means:
  routed around, its live ids forgotten, and its in-flight streams closed, so their requests
  fail at once with 503 instead of waiting on a dead peer.
- A changed boot id means the worker restarted and lost its live KV: live ids are cleared and
  `restarts` counted. It rejoins only with the expected fingerprint and volume.
- A request when every worker is remote and down fails at once with 503 (`WorkerFailed`).
- A worker has one slot per sequence (`--parallel`, its /health says how many). The pool knows
  each slot's live token ids (what was sent plus what was generated, as the worker reported),
  routes to a slot with `policies.router`, and queues at most `max_queue` requests: past that,
  429. A release after the worker restarted or went down records no live ids; a worker that
  restarts or goes down forgets every slot's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from backend import volume
from backend.keys import CacheIdentity
from backend.protocol import TierEvent, WorkerInfo
from backend.redact import redact_url
from policies.preempt import PARK_RECHECK_S
from policies.prefix import Batching
from policies.router import WAIT_MARGIN_TOKENS, choose_slot
from proxy.config import Config
from proxy.errors import QueueFull, WorkerFailed
from proxy.give_way import free, idle, park, preempt
from proxy.local_workers import LocalWorkers
from proxy.worker_link import (
    _UNREACHABLE,
    Slot,
    StartupError,
    Worker,
    WorkerLoading,
    WorkerMalformed,
    adopt_identity,
    incompatibility,
    metadata_of,
    slot_views,
)

log = logging.getLogger("prefixgate.workers")


REMOTE_WAIT_S = 600.0  # how long startup waits for a remote worker to answer
PROBE_INTERVAL_S = 1.0  # remote health probes
PROBE_TIMEOUT_S = 3.0
PROBE_TIMEOUTS_DOWN = 3  # consecutive probe timeouts that mark a remote worker down
RECHECK_TRIES = 40  # after a lost stream: health probes before leaving it to its supervisor
RECHECK_INTERVAL_S = 0.25
EVENTS_RETRY_S = 0.5  # a worker's tier events stream that ended is asked for again this late


class Pool(LocalWorkers):
    def __init__(self, cfg: Config, identity: CacheIdentity | None = None) -> None:
        self.cfg = cfg
        # the cache identity every worker must match (None: not checked); the devices that
        # compute are the first worker's (a worker says them), then every other's must match
        self.identity = identity
        self.volume_id = ""  # the cache volume every remote worker must report
        self.workers: list[Worker] = []
        self._cond = asyncio.Condition()
        self._waiting = 0
        self._first = 0  # preempted runs waiting: they take the next free slot (`acquire`)
        self._tmpdir = tempfile.mkdtemp(prefix="prefixgate-")
        self._tasks: list[asyncio.Task[None]] = []
        self._rechecks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.sleeping = False  # the local workers were stopped after idling (`sleep`)
        self._waking = asyncio.Lock()
        self.used_s = time.monotonic()  # when a request last took or gave back a slot
        # every worker's tier events as they come, and None when its stream ended (its states
        # are unknown then): the host's KV events (proxy/kv_events.py)
        self.on_tier: Callable[[str, TierEvent | None], None] | None = None

    @property
    def batching(self) -> Batching:
        """The workers' prefill batches (one model and configuration for all; before any has
        reported, the configured batch size's multiples)."""
        for w in self.workers:
            if w.ready:
                return w.batching
        return Batching(self.cfg.batch)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.cfg.worker_url:
            return await self._start_remote()
        for i in range(self.cfg.workers):
            sock = os.path.join(self._tmpdir, f"worker{i}.sock")
            w = Worker(i, "http://worker", socket_path=sock)
            w.session = w.new_session()
            self.workers.append(w)
        try:
            await self._start_local()
        except BaseException:
            await self.close()  # no orphaned worker processes
            raise

    async def close(self) -> None:
        self._closing = True
        for t in [*self._tasks, *self._rechecks]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._rechecks, return_exceptions=True)
        await self._stop_processes()
        for w in self.workers:
            if w.session:
                await w.session.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._tmpdir):
                os.unlink(os.path.join(self._tmpdir, name))
            os.rmdir(self._tmpdir)

    async def _listen(self, w: Worker) -> None:
        """The worker's tier events (`GET /events`: its RAM tier's entries as they are, then
        every change), for as long as the pool runs: the proxy's view of its RAM tier
        (`Worker.ram`). A stream that fails or ends forgets the view and connects again once the
        worker is ready."""
        while not self._closing:
            if w.ready and w.session is not None:
                try:
                    await w.follow_tiers(self.on_tier)
                except (*_UNREACHABLE, ValueError) as e:
                    log.debug("%s: its tier events stopped (%s)", w.name, e)
                w.ram = {}
                if self.on_tier is not None:
                    self.on_tier(w.name, None)
            await asyncio.sleep(EVENTS_RETRY_S)

    # --- remote workers --------------------------------------------------------------------

    async def _start_remote(self) -> None:
        for i, url in enumerate(self.cfg.worker_url):
            if not url.startswith(("http://", "https://")):
                raise StartupError(f"--worker-url {redact_url(url)} is not an http:// URL; give "
                                   "it as http://HOST:PORT of a `prefixgate worker --listen "
                                   "HOST:PORT`")
            w = Worker(i, url.rstrip("/"))
            w.session = w.new_session()
            self.workers.append(w)
        if self.cfg.disk_prefix_cache != "off":
            self.volume_id = await asyncio.to_thread(volume.ensure, self.cfg.cache_path)
        contacts = [asyncio.create_task(self._first_contact(w)) for w in self.workers]
        try:
            await asyncio.gather(*contacts)
        except BaseException:
            for t in contacts:
                t.cancel()
            await asyncio.gather(*contacts, return_exceptions=True)
            await self.close()
            raise
        self._tasks = [asyncio.create_task(self._watch(w)) for w in self.workers]
        self._tasks += [asyncio.create_task(self._listen(w)) for w in self.workers]

    def _incompatibility(self, h: WorkerInfo) -> str | None:
        return incompatibility(h, self.identity, self.cfg.n_ctx, self.cfg.model_path,
                               self.volume_id, self.cfg.parallel, metadata_of(self.cfg))

    @property
    def fingerprint(self) -> bytes:
        """The cache's fingerprint (complete once `start` returned: a worker said what computes)."""
        return b"" if self.identity is None else self.identity.fingerprint()

    def _adopt(self, w: Worker, h: WorkerInfo) -> None:
        if self.identity is not None and not self.identity.compute:  # the first worker
            adopted = adopt_identity(self.identity, h)
            changed = [f"{f.name} {getattr(adopted, f.name)!r} (configured here: "
                       f"{getattr(self.identity, f.name)!r})"
                       for f in dataclasses.fields(adopted) if f.name != "compute"
                       and getattr(adopted, f.name) != getattr(self.identity, f.name)]
            if changed:
                log.info("the cache keys take %s's settings: %s", w.name, "; ".join(changed))
            self.identity = adopted
        w.adopt(h)

    async def _first_contact(self, w: Worker) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        next_note = start + 10.0
        while True:
            try:
                h = await w.health(PROBE_TIMEOUT_S)
                break
            except _UNREACHABLE as e:
                if isinstance(e, WorkerLoading):  # loading: no limit while it makes progress
                    w.loading, start = e.status, loop.time()
                now = loop.time()
                if now - start > REMOTE_WAIT_S:
                    raise StartupError(f"{w.name} did not answer /health within "
                                       f"{REMOTE_WAIT_S:.0f} s ({e or type(e).__name__}); "
                                       "is `prefixgate worker --listen` running there?") from None
                if now >= next_note:
                    log.info("waiting for %s (%s)", w.name, e or type(e).__name__)
                    next_note = now + 10.0
                await asyncio.sleep(0.5)
        problem = self._incompatibility(h)
        if problem:
            raise StartupError(f"{w.name}: {problem}")
        self._adopt(w, h)
        await self._set_ready(w, True)
        log.info("%s ready (pid %s, n_ctx %d, %s)", w.name, h.pid, w.n_ctx,
                 w.memory_note)

    async def _set_ready(self, w: Worker, ready: bool, reason: str = "") -> None:
        async with self._cond:
            # ready: loading is over; down: a restart reports its own from 0
            w.ready, w.down_reason, w.loading = ready, reason, None
            if not ready:
                w.forget()
            self._cond.notify_all()

    async def _watch(self, w: Worker) -> None:
        """Probe one remote worker for as long as the pool runs."""
        timeouts = 0
        while not self._closing:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                h = await w.health(PROBE_TIMEOUT_S)
            except asyncio.TimeoutError:
                timeouts += 1
                if w.ready and timeouts >= PROBE_TIMEOUTS_DOWN:
                    await self._lose(w, f"no answer to {timeouts} health probes")
                continue
            except (aiohttp.ClientError, OSError) as e:
                if w.ready:
                    await self._lose(w, f"unreachable ({e or type(e).__name__})")
                continue
            except WorkerMalformed as e:  # another version took its place
                await self._keep_out(w, str(e))
                continue
            timeouts = 0
            await self._on_health(w, h)

    async def _on_health(self, w: Worker, h: WorkerInfo) -> None:
        boot_id = h.boot_id
        if boot_id != w.boot_id:
            w.restarts += 1
            w.boot_id = boot_id
            if w.ready:
                await self._lose(w, "restarted (its live KV is gone)")
            log.warning("%s restarted (restart %d); its live KV is gone", w.name, w.restarts)
        if problem := self._incompatibility(h):
            return await self._keep_out(w, problem)
        if not w.ready:
            self._adopt(w, h)
            await self._set_ready(w, True)
            log.info("%s is back (pid %s)", w.name, h.pid)

    async def _keep_out(self, w: Worker, problem: str) -> None:
        if w.ready or w.down_reason != problem:  # said once
            log.error("%s is kept out: %s", w.name, problem)
            await self._lose(w, problem)

    async def _recheck(self, w: Worker) -> None:
        boot_id = w.boot_id
        try:
            for _ in range(RECHECK_TRIES):
                if w.process is not None and w.process.returncode is not None:
                    return  # it died: its supervisor restarts it
                try:
                    h = await w.health(PROBE_TIMEOUT_S)
                except asyncio.TimeoutError:  # slow, not dead: ask again
                    await asyncio.sleep(RECHECK_INTERVAL_S)
                    continue
                except (aiohttp.ClientError, OSError) as e:  # refused: it is gone
                    w.down_reason = f"unreachable after a lost stream ({e or type(e).__name__})"
                    return  # a local one is restarted by its supervisor, a remote one probed
                except WorkerMalformed:
                    return  # another version took its place: its watcher keeps it out
                if h.boot_id == boot_id and not self._closing:
                    log.info("%s answers again after a lost stream", w.name)
                    await self._set_ready(w, True)
                return  # a new boot id: restarted, its supervisor or watcher takes it back
        finally:
            async with self._cond:  # waiting requests look again (all remote ones down: 503)
                w.checking = False
                self._cond.notify_all()

    async def _lose(self, w: Worker, reason: str) -> None:
        await self._set_ready(w, False, reason)
        n = len(w.streams)
        await w.abort()
        log.warning("%s is down: %s; routing around it%s", w.name, reason,
                    f", {n} request(s) in flight failed" if n else "")

    # --- routing ---------------------------------------------------------------------------

    async def worker_stats(self) -> dict[int, dict[str, Any]]:
        """Each ready worker's RAM tier and shared tier use (its /health), by worker id; one
        that does not answer in time is left out."""
        async def one(w: Worker) -> tuple[int, dict[str, Any]] | None:
            try:
                h = await w.health(PROBE_TIMEOUT_S)
            except (*_UNREACHABLE, ValueError):
                return None
            return w.worker_id, {"cache_ram": dict(h.cache_ram), "shared": dict(h.shared or {}),
                                 "speculation": dict(h.speculation)}
        got = await asyncio.gather(*(one(w) for w in self.workers if w.ready))
        return dict(g for g in got if g is not None)

    def busy(self) -> bool:
        return any(s.busy for s in self.slots)

    @property
    def all_ready(self) -> bool:
        return bool(self.workers) and all(w.ready for w in self.workers)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def _check_reachable(self) -> None:
        """503 at once when no worker can take a request and none is coming back by itself."""
        if self.workers and all(w.remote and not w.ready and not w.checking
                                for w in self.workers):
            why = "; ".join(f"{w.name}: {w.down_reason or 'down'}" for w in self.workers)
            raise WorkerFailed(f"no worker is reachable ({why}); retry when one is back")

    @property
    def slots(self) -> list[Slot]:
        return [s for w in self.workers for s in w.slots]

    async def acquire(self, ids: Sequence[int], disk_hit: int, tenant: str = "",
                      max_tokens: int | None = None, first: bool = False) -> Slot:
        """The slot to run this prompt on, marked busy; waits (bounded) when all are busy.
        `max_tokens`: the most it may generate, where it may take the slot of a run still
        prefilling a long prompt rather than wait (policies/preempt.py); `first`: a run that
        gave way, which takes the next free slot before anyone else."""
        self._check_reachable()
        if not first and self._waiting >= self.cfg.max_queue and not any(
                s.ready and not s.busy for s in self.slots):
            raise QueueFull(f"all {len(self.slots)} slots are busy and "
                            f"{self._waiting} requests are waiting; retry shortly")
        self._waiting += 1
        self._first += first
        me, preempted = object(), max_tokens is None
        try:
            while True:
                if self.sleeping:
                    await self.wake()
                async with self._cond:
                    while not self.sleeping:
                        slots = self.slots
                        mine = next((s for s in slots if s.reserved is me), None)
                        if mine is not None and not mine.ready:
                            mine.reserved = None  # its worker went down: queue as the others
                        elif mine is not None:
                            if not mine.busy:
                                mine.reserved = None
                                return self._take(mine)
                        elif first or not self._first:
                            # a run that gave way takes any idle slot (no margin to wait for)
                            choice = choose_slot(slot_views(slots, ids, tenant), disk_hit,
                                                 1 << 62 if first else WAIT_MARGIN_TOKENS)
                            if choice is not None and not slots[choice].busy \
                                    and slots[choice].reserved is None:
                                return self._take(slots[choice])
                            waiter = (disk_hit, len(ids))
                            if not preempted and not idle(slots):
                                if preempt(slots, me, waiter, max_tokens or 0):
                                    preempted = True  # at most one run gives way to it
                                    continue
                                nest = park(slots, waiter, max_tokens or 0)
                                if nest is not None:
                                    return self._take(nest)
                        with contextlib.suppress(TimeoutError):  # the runs that generate go
                            await asyncio.wait_for(  # on: rule 4 is asked again as they do
                                self._cond.wait(), None if preempted else PARK_RECHECK_S)
                        self._check_reachable()
        finally:
            self._waiting -= 1
            self._first -= first
            for s in self.slots:
                if s.reserved is me:  # it was cancelled while waiting for its slot
                    s.reserved = None
                    self._cond_notify_soon()

    def _take(self, s: Slot) -> Slot:
        s.busy = True
        s.acquired_at_restarts = s.worker.restarts
        self.used_s = time.monotonic()
        return s

    def _cond_notify_soon(self) -> None:
        async def notify() -> None:
            async with self._cond:
                self._cond.notify_all()
        task = asyncio.ensure_future(notify())
        self._rechecks.add(task)
        task.add_done_callback(self._rechecks.discard)

    async def hold(self, s: Slot, holder: Any) -> None:
        """The run on `s` started: a short request may ask it to give way from now on."""
        async with self._cond:
            if s.busy:
                s.holder = holder
                self._cond.notify_all()

    async def give_back(self, s: Slot) -> None:
        """A slot acquired and never run on (its request left): free, its live KV as it was."""
        async with self._cond:
            free(s)
            self._cond.notify_all()

    async def lapse(self, s: Slot) -> None:
        """Its run had sampled when asked to give way: the slot is no one's promise any more."""
        async with self._cond:
            s.reserved = None
            self._cond.notify_all()

    async def release(self, s: Slot, live_ids: Sequence[int], tenant: str = "",
                      suspect: bool = False, floor: int = 0,
                      costs: dict[str, Any] | None = None) -> None:
        """The run is over. `suspect`: its stream was lost, so the worker may have died; it
        takes no request until its /health answers with the same boot id (`_recheck`), and a
        local worker that died is restarted by its supervisor meanwhile: requests queued behind
        a crash wait for it instead of failing on the dead process."""
        async with self._cond:
            w = s.worker
            if costs:
                w.learn(costs)
            # a worker that restarted or went down while running this request holds nothing
            fresh = w.ready and w.restarts == s.acquired_at_restarts
            if s.outer is None:  # a nested job's KV gives way to its slot's run's at its end
                s.live_ids = live_ids if fresh else ()
                s.live_floor = min(floor, len(s.live_ids))
                # an empty view belongs to nobody: a run that failed before the worker ran it
                # leaves the previous tenant's KV there, which the failing tenant must not reuse
                s.live_tenant = tenant if s.live_ids else ""
            s.used_s = self.used_s = time.monotonic()
            if suspect and w.ready:
                w.ready, w.checking = False, True
                w.forget()
                task = asyncio.create_task(self._recheck(w))
                self._rechecks.add(task)
                task.add_done_callback(self._rechecks.discard)
            free(s)
            self._cond.notify_all()
