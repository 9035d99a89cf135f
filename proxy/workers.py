"""Worker supervision and the pool the gateway draws workers from.

Two kinds of worker behind the same HTTP API (backend/worker.py):

- **local** (`--workers N`): processes spawned here, each on a Unix socket. One that exits is
  restarted; requests wait for it meanwhile (it comes back by itself).
- **remote** (`--worker-url URL`, repeatable; replaces `--workers`): a `prefixgate worker
  --listen HOST:PORT` in another process or container, sharing the cache directory (a volume).
  The proxy neither starts nor stops it; it probes it.

Rules:

- At startup every worker must answer `/health` with the proxy's fingerprint (same model file,
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
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from backend import volume
from backend.keys import CacheIdentity
from backend.protocol import (
    DecodeInfo,
    Event,
    Job,
    Loading,
    TierEvent,
    WorkerInfo,
    parse_event,
    placement_note,
)
from backend.redact import redact_url
from policies.costs import Costs
from policies.prefix import Batching, common_prefix_len, live_reuse, measured_at_start
from policies.router import SlotView, choose_slot
from proxy.config import Config, worker_argv
from proxy.errors import QueueFull, WorkerFailed

log = logging.getLogger("prefixgate.workers")

LOADING_NOTE_S = 15.0  # a local worker still loading its model says so this often
REMOTE_WAIT_S = 600.0  # how long startup waits for a remote worker to answer
PROBE_INTERVAL_S = 1.0  # remote health probes
PROBE_TIMEOUT_S = 3.0
PROBE_TIMEOUTS_DOWN = 3  # consecutive probe timeouts that mark a remote worker down
CONNECT_TIMEOUT_S = 10.0  # connecting to a worker for a run
CANCEL_TIMEOUT_S = 2.0  # a cancel the worker does not answer in time: close the stream instead
RECHECK_TRIES = 40  # after a lost stream: health probes before leaving it to its supervisor
RECHECK_INTERVAL_S = 0.25
EVENTS_RETRY_S = 0.5  # a worker's tier events stream that ended is asked for again this late

_UNREACHABLE = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class WorkerLoading(aiohttp.ClientError):
    """A worker that answers /health 503 while it loads: not ready yet (an unreachable one, to
    every rule that does not look closer), with its phase and progress."""

    def __init__(self, status: Loading) -> None:
        super().__init__(f"loading ({status.phase}, {status.progress:.0%})")
        self.status = status


class StartupError(RuntimeError):
    """A worker cannot be used: the proxy refuses to start. The message says what to fix."""


class WorkerMalformed(ValueError):
    """A worker's /health that is not a `WorkerInfo` (another version, or not a worker)."""


class EventStream:
    """A worker's NDJSON event stream; `next()` raises WorkerFailed when it fails or ends."""

    def __init__(self, resp: aiohttp.ClientResponse, name: str) -> None:
        self.resp, self.name = resp, name

    async def next(self) -> Event:
        try:
            line = await self.resp.content.readline()
        except _UNREACHABLE as e:
            raise WorkerFailed(f"{self.name} failed mid-request: {e or type(e).__name__}"
                               ) from e
        if not line:
            raise WorkerFailed(f"{self.name} ended the stream early")
        try:
            return parse_event(line)
        except ValueError as e:
            raise WorkerFailed(f"{self.name} sent a bad event: {e}") from e

    def close(self) -> None:
        self.resp.close()


@dataclass(eq=False)
class Slot:
    """One sequence of a worker: where the router places a request, and what `proxy.run.Run`
    talks to (its jobs go to the worker with this slot's index)."""

    worker: Worker
    index: int
    live_ids: list[int] = field(default_factory=list)  # the proxy's view of its live KV
    live_tenant: str = ""  # whose prompt the live KV holds (tenant isolation)
    live_floor: int = 0  # the shortest prefix of live_ids its memory can be cut back to
    busy: bool = False
    acquired_at_restarts: int = 0  # the worker's `restarts` when acquired: see Pool.release
    used_s: float = 0.0  # when it last ran a request (monotonic)

    @property
    def worker_id(self) -> int:
        return self.worker.worker_id

    @property
    def label(self) -> str:
        """For log lines: "0", or "0.1" for slot 1 of worker 0 when it has several."""
        return f"{self.worker_id}.{self.index}" if len(self.worker.slots) > 1 \
            else str(self.worker_id)

    @property
    def ready(self) -> bool:
        return self.worker.ready

    def forget(self) -> None:
        self.live_ids, self.live_tenant, self.live_floor = [], "", 0

    def live_prefix(self, ids: list[int] | tuple[int, ...], tenant: str) -> int:
        """Tokens of `ids` its live KV holds that this tenant may reuse: all it shares, or
        none where the worker's memory cannot be cut back that far (a recurrent state: only
        the whole live sequence; a sliding window: not behind the window)."""
        if tenant != self.live_tenant:
            return 0
        return live_reuse(common_prefix_len(self.live_ids, ids), len(self.live_ids),
                          self.live_floor)

    def view(self, slot_id: int, ids: list[int], tenant: str, borrow: int = 0) -> SlotView:
        return SlotView(slot_id, self.live_prefix(ids, tenant), self.busy, self.ready,
                        len(self.live_ids), self.used_s, borrow)

    def run(self, job: Job, timeout_s: float) -> contextlib.AbstractAsyncContextManager[
            EventStream]:
        return self.worker.run(dataclasses.replace(job, slot=self.index), timeout_s)

    async def cancel(self, run_id: str) -> bool:
        return await self.worker.cancel(run_id)


@dataclass(eq=False)
class Worker:
    worker_id: int
    base_url: str  # "http://worker" over a Unix socket, or a remote http://host:port
    socket_path: str | None = None
    session: aiohttp.ClientSession | None = None
    process: asyncio.subprocess.Process | None = None
    slots: list[Slot] = field(default_factory=list)  # one per sequence (its /health: "slots")
    ready: bool = False
    n_ctx: int = 0
    fingerprint: str = ""
    memory: str = "plain"  # what its model's memory allows (backend.engine.Memory kind)
    # it copies part of one slot's live KV into another (plain memory, a RAM tier: its
    # `_from_memory`), so a prompt sharing a prefix with one slot is as well off in any of them
    borrows: bool = False
    batching: Batching = Batching()  # its prefill batches: it reuses only at their edges
    exact: bool = True  # its start-up self-check passed (false: it reuses nothing)
    exact_failure: str = ""  # why not, from its /health
    # how its slots' decode steps run (--deterministic and its self-check:
    # policies.schedule.choose_decode); None before it said
    decode: DecodeInfo | None = None
    restarts: int = 0
    boot_id: str = ""  # the worker process's id from /health; a new one = a restart
    down_reason: str = ""  # why a remote worker is not ready, for logs and 503 messages
    streams: set[aiohttp.ClientResponse] = field(default_factory=set)  # in-flight /run streams
    checking: bool = False  # a run's stream was lost: waiting for its /health (Pool._recheck)
    loading: Loading | None = None  # its /health while it loads
    # its RAM tier's entries, ref -> (tenant, ids), as its tier events say (Pool._listen)
    ram: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    costs: Costs | None = None  # its measured prefill and restore costs (policies.costs)
    placement: dict[str, Any] = field(default_factory=dict)  # where its model went

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = [Slot(self, 0)]

    @property
    def remote(self) -> bool:
        return self.socket_path is None

    @property
    def busy(self) -> bool:
        return any(s.busy for s in self.slots)

    def forget(self) -> None:
        """Its live KV is gone (a restart) or unknown (down): every slot's."""
        for s in self.slots:
            s.forget()

    def learn(self, costs: dict[str, Any]) -> None:
        """Its costs as it reported them (a `Done`, its /health); malformed: kept as they were."""
        try:
            self.costs = Costs.from_wire(costs)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s reported malformed costs: %s", self.name, e)

    def set_slots(self, n: int) -> None:
        if n != len(self.slots):
            self.slots = [Slot(self, i) for i in range(n)]

    @property
    def memory_note(self) -> str:
        """Its slots, memory, reuse granularity and self-check's verdict for the ready line."""
        where = placement_note(self.placement)
        b = self.batching
        return (f"{len(self.slots)} slot(s), memory {self.memory}, reuse at batch edges (batch "
                f"{b.size}" + (f", or message ends past {b.least}" if b.ends else "") + "), "
                + ("exact" if self.exact else f"REUSE OFF ({self.exact_failure})")
                + (f"; {self.decode.note}" if self.decode is not None and len(self.slots) > 1
                   else "")
                + (f"; {where}" if where else ""))

    @property
    def name(self) -> str:
        return f"worker {self.worker_id}" + (f" at {redact_url(self.base_url)}" if self.remote
                                             else "")

    def new_session(self) -> aiohttp.ClientSession:
        if self.socket_path is not None:
            return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket_path))
        return aiohttp.ClientSession()

    async def health(self, timeout_s: float = 2.0) -> WorkerInfo:
        """Its /health, parsed strictly (`WorkerMalformed` where it is not a `WorkerInfo`)."""
        assert self.session is not None
        async with self.session.get(self.base_url + "/health",
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status == 503:
                with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                    raise WorkerLoading(Loading.from_wire(await r.json()))
            r.raise_for_status()
            try:
                return WorkerInfo.from_wire(await r.json(content_type=None))
            except ValueError as e:
                raise WorkerMalformed(f"{self.name} answers /health with something this proxy "
                                      f"does not read ({e}): run the same prefixgate version "
                                      "on both") from None

    @contextlib.asynccontextmanager
    async def run(self, job: Job, timeout_s: float) -> AsyncIterator[EventStream]:
        """POST the job; the events of its run, parsed (proxy.run.WorkerClient)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        try:
            async with self.session.post(self.base_url + "/run", json=job.to_wire(),
                                         timeout=timeout) as r:
                r.raise_for_status()
                self.streams.add(r)
                try:
                    yield EventStream(r, self.name)
                finally:
                    self.streams.discard(r)
        except _UNREACHABLE as e:
            raise WorkerFailed(f"{self.name} failed: {e or type(e).__name__}") from e

    async def cancel(self, run_id: str) -> bool:
        """Ask the worker to stop a run (its stream then reports `cancelled`); False when the
        worker did not take it (the run already ended, or the worker is unreachable)."""
        assert self.session is not None
        try:
            async with self.session.post(self.base_url + "/cancel", json={"run_id": run_id},
                                         timeout=aiohttp.ClientTimeout(total=CANCEL_TIMEOUT_S)
                                         ) as r:
                return r.status == 200
        except _UNREACHABLE:
            return False

    async def abort(self) -> None:
        """Fail everything in flight on this worker now: its streams and pending connections
        (a dead or partitioned peer would otherwise keep them waiting until a timeout)."""
        for r in list(self.streams):
            r.close()
        if self.session is not None:
            old, self.session = self.session, self.new_session()
            await old.close()


def child_env(root: str | Path) -> dict[str, str]:
    """This process's environment for a child Python that runs the tree at `root`: the tree
    first on PYTHONPATH, then what this process was given (packages installed beside the
    interpreter's own, as where wheels are carried to a machine without a network)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}


def loading_note(status: Loading | None) -> str:
    """"loading the model 42%" from a loading worker's /health ("starting" before it answers)."""
    if status is None:
        return "starting"
    return f"{status.phase} {status.progress:.0%}"


def worker_gpus(visible: str | None, workers: int, worker_id: int, n_gpu_layers: int
                ) -> str | None:
    """The GPUs a local worker sees (its CUDA_VISIBLE_DEVICES), or None to leave them as they
    are. `--workers N` is for N GPUs, one worker each (its `--parallel` slots share it): with
    GPU layers, several workers and a CUDA_VISIBLE_DEVICES listing at least as many devices,
    worker i gets the i-th; otherwise every worker sees what the proxy sees (llama.cpp then
    splits each model across all of them)."""
    if workers < 2 or n_gpu_layers == 0 or not visible:
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    return devices[worker_id] if len(devices) >= workers else None


def incompatibility(h: WorkerInfo, identity: CacheIdentity | None, n_ctx: int,
                    model_path: str, volume_id: str, slots: int = 1) -> str | None:
    """Why a worker whose /health says `h` cannot serve this proxy (whose cache `identity` is
    the first ready worker's, `adopt_identity`, if any came first), or None."""
    if h.n_ctx != n_ctx:
        return (f"it runs n_ctx {h.n_ctx} but the proxy expects {n_ctx}: start both with the "
                "same --n-ctx")
    if h.slots != slots:
        return (f"it runs {h.slots} slots but the proxy expects {slots} (each gets --n-ctx / "
                "--parallel tokens): start both with the same --parallel")
    if identity is None:
        return None
    if identity.compute and h.identity.compute != identity.compute:
        return (f"it computes on {h.compute or 'unnamed devices'}, the other workers on "
                f"{identity.compute}: a state one makes is not the bits the other computes cold, "
                "so one cache cannot serve both; run a prefixgate (or a cache directory) per kind "
                "of device")
    if identity.compute:  # not the first: every field as the first worker's
        theirs = adopt_identity(identity, h)
        differ = [f"{f.name} {getattr(theirs, f.name)!r} (the others: "
                  f"{getattr(identity, f.name)!r})" for f in dataclasses.fields(identity)
                  if getattr(theirs, f.name) != getattr(identity, f.name)]
        if differ:
            return (f"its cache settings differ from the other workers': {'; '.join(differ)}; "
                    "start every worker with the same flags")
    fingerprint = adopt_identity(identity, h).fingerprint()
    if h.fingerprint != fingerprint.hex():
        return (f"its model file differs from the proxy's: it serves {h.model!r}, the proxy "
                f"{model_path!r} (llama-cpp-python {h.llama_cpp_version}); use the same GGUF "
                f"file on both (fingerprint {h.fingerprint} != {fingerprint.hex()})")
    if volume_id and h.cache_volume != volume_id:
        return (f"it does not share the proxy's cache directory (volume id "
                f"{h.cache_volume or 'missing'!r} != {volume_id!r}): mount the same "
                "volume as the worker's --cache-dir and the proxy's --cache-dir")
    return None


def adopt_identity(identity: CacheIdentity, h: WorkerInfo) -> CacheIdentity:
    """The proxy's cache identity with every field a worker reports (the batch, KV types, flash
    attention, library version, the devices that compute) taken from it: a proxy in a CPU
    container keys the states a GPU worker computes as that worker does. The model file stays
    the proxy's own (the fingerprint then tells whether both serve the same file)."""
    return CacheIdentity(**{**dataclasses.asdict(h.identity), "model_path": identity.model_path})


class Pool:
    def __init__(self, cfg: Config, identity: CacheIdentity | None = None) -> None:
        self.cfg = cfg
        # the cache identity every worker must match (None: not checked); the devices that
        # compute are the first worker's (a worker says them), then every other's must match
        self.identity = identity
        self.volume_id = ""  # the cache volume every remote worker must report
        self.workers: list[Worker] = []
        self._cond = asyncio.Condition()
        self._waiting = 0
        self._tmpdir = tempfile.mkdtemp(prefix="prefixgate-")
        self._tasks: list[asyncio.Task[None]] = []
        self._rechecks: set[asyncio.Task[None]] = set()
        self._closing = False
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
            if measured_at_start(self.cfg.n_gpu_layers, self.cfg.worker_batch,
                                 self.cfg.flash_attn):  # the others recall what it measured
                await self._spawn(self.workers[0])
            await asyncio.gather(*(self._spawn(w) for w in self.workers if not w.ready))
        except BaseException:
            await self.close()  # no orphaned worker processes
            raise
        self._tasks = [asyncio.create_task(self._supervise(w)) for w in self.workers]
        self._tasks += [asyncio.create_task(self._listen(w)) for w in self.workers]

    async def close(self) -> None:
        self._closing = True
        for t in [*self._tasks, *self._rechecks]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._rechecks, return_exceptions=True)
        for w in self.workers:
            if w.process and w.process.returncode is None:
                w.process.terminate()
        for w in self.workers:
            if w.process:
                try:
                    await asyncio.wait_for(w.process.wait(), 10)
                except asyncio.TimeoutError:
                    w.process.kill()
            if w.session:
                await w.session.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._tmpdir):
                os.unlink(os.path.join(self._tmpdir, name))
            os.rmdir(self._tmpdir)

    # --- local workers ---------------------------------------------------------------------

    def _command(self, w: Worker) -> list[str]:
        return [sys.executable, "-m", "proxy.cli", "worker", "--socket", str(w.socket_path),
                "--worker-id", str(w.worker_id), *worker_argv(self.cfg)]

    async def _spawn(self, w: Worker) -> None:
        w.ready = False
        w.forget()
        # the proxy's own tree first, then whatever the proxy was given
        env = child_env(Path(__file__).resolve().parent.parent)
        if self.cfg.shared_tier:  # not on the command line: the URL may hold a password
            env["PREFIXGATE_SHARED_TIER"] = self.cfg.shared_tier
        gpus = worker_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), self.cfg.workers,
                           w.worker_id, self.cfg.n_gpu_layers)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
            log.info("worker %d gets GPU %s (CUDA_VISIBLE_DEVICES)", w.worker_id, gpus)
        w.process = await asyncio.create_subprocess_exec(*self._command(w), env=env)
        await self._wait_ready(w)

    async def _wait_ready(self, w: Worker) -> None:
        """As long as its process lives: a 60 GB model from a slow disk loads for minutes (no
        fixed limit, as in llama-server); it says every LOADING_NOTE_S how far it got."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        note = start + LOADING_NOTE_S
        log.info("worker %d loading %s", w.worker_id, os.path.basename(self.cfg.model_path))
        while True:
            if w.process and w.process.returncode is not None:
                raise RuntimeError(f"worker {w.worker_id} exited with {w.process.returncode} "
                                   "while starting (see its log above)")
            try:
                h = await w.health()
                break
            except _UNREACHABLE as e:
                if isinstance(e, WorkerLoading):
                    w.loading = e.status
                if loop.time() >= note:
                    log.info("worker %d is loading %s: %s, %.0f s", w.worker_id,
                             os.path.basename(self.cfg.model_path), loading_note(w.loading),
                             loop.time() - start)
                    note += LOADING_NOTE_S
                await asyncio.sleep(0.1)
        problem = incompatibility(h, self.identity, self.cfg.n_ctx, self.cfg.model_path, "",
                                  self.cfg.parallel)
        if problem:
            raise StartupError(f"{w.name}: {problem}")
        self._adopt(w, h)
        async with self._cond:
            w.ready = True
            self._cond.notify_all()
        log.info("worker %d ready (pid %s, n_ctx %d, %s)", w.worker_id,
                 w.process.pid if w.process else "-", w.n_ctx, w.memory_note)

    async def _listen(self, w: Worker) -> None:
        """The worker's tier events (`GET /events`: its RAM tier's entries as they are, then
        every change), for as long as the pool runs: the proxy's view of its RAM tier
        (`Worker.ram`). A stream that fails or ends forgets the view and connects again once the
        worker is ready."""
        while not self._closing:
            if not w.ready or w.session is None:
                await asyncio.sleep(EVENTS_RETRY_S)
                continue
            boot_id = w.boot_id
            try:
                async with w.session.get(w.base_url + ("/events?all=1" if self.on_tier
                                                       else "/events"),
                                         timeout=aiohttp.ClientTimeout(total=None)) as r:
                    r.raise_for_status()
                    w.ram = {}
                    while line := await r.content.readline():
                        ev = parse_event(line)
                        if isinstance(ev, TierEvent) and self.on_tier is not None:
                            self.on_tier(w.name, ev)
                        if isinstance(ev, TierEvent) and ev.tier == "ram":
                            if ev.kind == "stored":
                                w.ram[ev.ref] = (ev.tenant, ev.ids)
                            else:
                                w.ram.pop(ev.ref, None)
                        if w.boot_id != boot_id:
                            break
            except (*_UNREACHABLE, ValueError) as e:
                log.debug("%s: its tier events stopped (%s)", w.name, e)
            w.ram = {}
            if self.on_tier is not None:
                self.on_tier(w.name, None)
            await asyncio.sleep(EVENTS_RETRY_S)

    async def _supervise(self, w: Worker) -> None:
        """Restart a worker process that exits; its in-flight request fails on its own."""
        while not self._closing:
            assert w.process is not None
            rc = await w.process.wait()
            if self._closing:
                return
            w.ready = False
            w.restarts += 1
            log.error("worker %d exited with %s; restarting", w.worker_id, rc)
            try:
                await self._spawn(w)
            except RuntimeError as e:
                log.error("%s", e)
                await asyncio.sleep(1.0)

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
                               self.volume_id, self.cfg.parallel)

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
        w.n_ctx, w.fingerprint = h.n_ctx, h.fingerprint
        w.memory, w.batching = h.memory, Batching(h.align, frozenset(h.batch_ends))
        w.exact, w.exact_failure, w.decode = h.exact, h.exact_failure, h.decode
        w.borrows, w.boot_id = h.borrows, h.boot_id
        w.set_slots(h.slots)
        w.placement, w.loading = dict(h.placement), None
        w.learn(h.costs)

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
            w.ready, w.down_reason = ready, reason
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
        problem = self._incompatibility(h)
        if problem:
            if w.ready or w.down_reason != problem:
                log.error("%s is kept out: %s", w.name, problem)
                await self._lose(w, problem)
            return
        if not w.ready:
            self._adopt(w, h)
            await self._set_ready(w, True)
            log.info("%s is back (pid %s)", w.name, h.pid)

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

    async def acquire(self, ids: list[int], disk_hit: int, tenant: str = "") -> Slot:
        """The slot to run this prompt on, marked busy; waits (bounded) when all are busy."""
        self._check_reachable()
        if self._waiting >= self.cfg.max_queue and not any(
                s.ready and not s.busy for s in self.slots):
            raise QueueFull(f"all {len(self.slots)} slots are busy and "
                            f"{self._waiting} requests are waiting; retry shortly")
        self._waiting += 1
        try:
            async with self._cond:
                while True:
                    slots = self.slots
                    choice = choose_slot(self._views(slots, ids, tenant), disk_hit)
                    if choice is not None:
                        s = slots[choice]
                        if not s.busy:
                            s.busy = True
                            s.acquired_at_restarts = s.worker.restarts
                            return s
                    await self._cond.wait()
                    self._check_reachable()
        finally:
            self._waiting -= 1

    @staticmethod
    def _views(slots: list[Slot], ids: list[int], tenant: str) -> list[SlotView]:
        """The router's view of each slot; `borrow`: what its worker can load into it from its
        memory (policies.sources): the longest prefix of the prompt its RAM tier holds (its
        tier events), and the longest live prefix of another of its slots where it copies
        between them."""
        prefix = [s.live_prefix(ids, tenant) for s in slots]
        def held(w: Worker) -> int:  # a state it cannot cut back counts only whole
            mine = [h for t, h in w.ram.values() if t == tenant]
            return max((n for h in mine
                        if (n := common_prefix_len(h, ids)) == len(h) or w.borrows), default=0)
        ram = {id(w): held(w) if w.exact else 0 for w in {s.worker for s in slots}}
        views = []
        for i, s in enumerate(slots):
            borrow = max((p for j, p in enumerate(prefix) if j != i
                          and slots[j].worker is s.worker), default=0) if s.worker.borrows else 0
            views.append(s.view(i, ids, tenant, max(borrow, ram[id(s.worker)])))
        return views

    async def release(self, s: Slot, live_ids: list[int], tenant: str = "",
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
            s.live_ids = live_ids if fresh else []
            s.live_floor = min(floor, len(s.live_ids))
            # an empty view belongs to nobody: a run that failed before the worker ran it
            # leaves the previous tenant's KV there, which the failing tenant must not reuse
            s.live_tenant = tenant if s.live_ids else ""
            s.used_s = time.monotonic()
            if suspect and w.ready:
                w.ready, w.checking = False, True
                w.forget()
                task = asyncio.create_task(self._recheck(w))
                self._rechecks.add(task)
                task.add_done_callback(self._rechecks.discard)
            s.busy = False
            self._cond.notify_all()
