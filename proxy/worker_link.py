"""One worker as the proxy sees it: the HTTP link to it, its slots, and the checks a worker
must pass to join (`proxy.workers.Pool` supervises them and routes among the slots).

    Worker.health() -> WorkerInfo        strict (backend.protocol): a malformed one is refused
    Worker.run(job) -> EventStream       a run's NDJSON events; cancel(), abort()
    Slot                                 one sequence of one worker: its live ids
    slot_views(slots, ids, tenant)       the router's view of each (policies.router)
    incompatibility(info, identity, ...) why a worker cannot serve this proxy, or None
    adopt_identity(identity, info)       the proxy's cache identity in the worker's terms
    worker_gpus(...), child_env(root), loading_note(status)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from backend import kv_override
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
from policies.prefix import Batching, common_prefix_len, live_reuse
from policies.router import SlotView
from proxy.errors import WorkerFailed

log = logging.getLogger("prefixgate.workers")


CONNECT_TIMEOUT_S = 10.0  # connecting to a worker for a run
CANCEL_TIMEOUT_S = 2.0  # a cancel the worker does not answer in time: close the stream instead

_UNREACHABLE = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class WorkerLoading(aiohttp.ClientError):
    """A worker that answers /health 503 while it loads: not ready yet (an unreachable one, to
    every rule that does not look closer), with its phase and progress."""

    def __init__(self, status: Loading) -> None:
        super().__init__(f"loading ({status.phase}, {status.progress:.0%})")
        self.status = status


class StartupError(RuntimeError):
    """A worker cannot be used: the proxy refuses to start. The message says what to fix."""


class WorkerMalformed(StartupError, ValueError):
    """A worker's /health that is not a `WorkerInfo` (another version, or not a worker): at
    start the proxy refuses to start (a `StartupError`), later the worker is kept out."""


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
    live_ids: Sequence[int] = ()  # the proxy's view of its live KV
    live_tenant: str = ""  # whose prompt the live KV holds (tenant isolation)
    live_floor: int = 0  # the shortest prefix of live_ids its memory can be cut back to
    busy: bool = False
    acquired_at_restarts: int = 0  # the worker's `restarts` when acquired: see Pool.release
    used_s: float = 0.0  # when it last ran a request (monotonic)
    # the run on it while it may give way to a short request (proxy.run.Run: `left`,
    # `give_way`), and the waiter it is promised to once that run stops (policies/preempt.py)
    holder: Any = None
    reserved: object | None = None
    # a short job nested on its generating run (policies/preempt.py rule 4): the slot it runs
    # on (`outer`: the slot whose run is parked for it) and, on that slot, the nested one;
    # `ended`: its run ended while a job was nested on it (the slot frees when that job ends)
    outer: Slot | None = None
    nested: Slot | None = None
    ended: bool = False

    @property
    def worker_id(self) -> int:
        return self.worker.worker_id

    @property
    def label(self) -> str:
        """For log lines: "0", or "0.1" for slot 1 of worker 0 when it has several."""
        return (f"{self.worker_id}.{self.index}" if len(self.worker.slots) > 1
                else str(self.worker_id)) + ("+nested" if self.outer is not None else "")

    @property
    def ready(self) -> bool:
        return self.worker.ready

    def forget(self) -> None:
        self.live_ids, self.live_tenant, self.live_floor = (), "", 0

    def live_prefix(self, ids: Sequence[int], tenant: str) -> int:
        """Tokens of `ids` its live KV holds that this tenant may reuse: all it shares, or
        none where the worker's memory cannot be cut back that far (a recurrent state: only
        the whole live sequence; a sliding window: not behind the window)."""
        if tenant != self.live_tenant:
            return 0
        return live_reuse(common_prefix_len(self.live_ids, ids), len(self.live_ids),
                          self.live_floor)

    def view(self, slot_id: int, ids: Sequence[int], tenant: str, borrow: int = 0) -> SlotView:
        return SlotView(slot_id, self.live_prefix(ids, tenant),
                        self.busy or self.reserved is not None, self.ready,
                        len(self.live_ids), self.used_s, borrow)

    def run(self, job: Job, timeout_s: float) -> contextlib.AbstractAsyncContextManager[
            EventStream]:
        return self.worker.run(dataclasses.replace(job, slot=self.index,
                                                   nest=self.outer is not None), timeout_s)

    async def cancel(self, run_id: str, prefilling: bool = False) -> bool:
        return await self.worker.cancel(run_id, prefilling)


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
    ram_tier: bool = False  # it keeps states that give way in RAM (--cache-ram not 0)
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

    def adopt(self, h: WorkerInfo) -> None:
        """What its /health says it is (it passed the pool's checks)."""
        self.n_ctx, self.fingerprint = h.n_ctx, h.fingerprint
        self.memory, self.batching = h.memory, Batching(h.align, frozenset(h.batch_ends))
        self.exact, self.exact_failure, self.decode = h.exact, h.exact_failure, h.decode
        self.borrows, self.boot_id = h.borrows, h.boot_id
        self.ram_tier = h.cache_ram.get("budget_bytes", 0) != 0
        self.set_slots(h.slots)
        self.placement = dict(h.placement)  # its loading progress stands until it is ready
        self.learn(h.costs)

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

    async def follow_tiers(self, on_tier: Callable[[str, TierEvent | None], None] | None
                           ) -> None:
        """Its tier events (`GET /events`; all of them, `?all=1`, for `on_tier`) until the
        stream ends or the worker restarts: its RAM tier's entries kept in `ram` (the proxy's
        view of it), and each event to `on_tier`."""
        assert self.session is not None
        boot_id = self.boot_id
        async with self.session.get(self.base_url + ("/events?all=1" if on_tier else "/events"),
                                    timeout=aiohttp.ClientTimeout(total=None)) as r:
            r.raise_for_status()
            self.ram = {}
            while self.boot_id == boot_id and (line := await r.content.readline()):
                ev = parse_event(line)
                if isinstance(ev, TierEvent) and on_tier is not None:
                    on_tier(self.name, ev)
                if isinstance(ev, TierEvent) and ev.tier == "ram":
                    if ev.kind == "stored":
                        self.ram[ev.ref] = (ev.tenant, ev.ids)
                    else:
                        self.ram.pop(ev.ref, None)

    @contextlib.asynccontextmanager
    async def run(self, job: Job, timeout_s: float) -> AsyncIterator[EventStream]:
        """POST the job; the events of its run, parsed (proxy.run.WorkerClient)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        try:
            async with self.session.post(self.base_url + "/run", data=job.encode(),
                                         timeout=timeout) as r:
                r.raise_for_status()
                self.streams.add(r)
                try:
                    yield EventStream(r, self.name)
                finally:
                    self.streams.discard(r)
        except _UNREACHABLE as e:
            raise WorkerFailed(f"{self.name} failed: {e or type(e).__name__}") from e

    async def cancel(self, run_id: str, prefilling: bool = False) -> bool:
        """Ask the worker to stop a run (its stream then reports `cancelled`); False when the
        worker did not take it (the run already ended, or the worker is unreachable).
        `prefilling`: only if it has not sampled yet (a preemption)."""
        assert self.session is not None
        body: dict[str, Any] = {"run_id": run_id}
        if prefilling:
            body["prefilling"] = True
        try:
            async with self.session.post(self.base_url + "/cancel", json=body,
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
    """"loading the model 42%" from a loading worker's /health ("starting" before it answers):
    its phase and how far into it (the self-check counts its own batches)."""
    if status is None:
        return "starting"
    return f"{status.phase} {status.step:.0%}"


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


def metadata_of(cfg: Any) -> str:
    """A Config's --override-kv, as its workers describe it (the placement's `metadata`)."""
    return kv_override.describe(kv_override.parse(cfg.override_kv))


def incompatibility(h: WorkerInfo, identity: CacheIdentity | None, n_ctx: int,
                    model_path: str, volume_id: str, slots: int = 1, metadata: str = ""
                    ) -> str | None:
    """Why a worker whose /health says `h` cannot serve this proxy (whose cache `identity` is
    the first ready worker's, `adopt_identity`, if any came first), or None. `metadata`: the
    proxy's --override-kv, described (backend.kv_override.describe), which its tokenizer and
    template read the model with."""
    if (theirs := str(h.placement.get("metadata", ""))) != metadata:
        return (f"it reads the model with {theirs or 'no metadata changed'}, the proxy with "
                f"{metadata or 'no metadata changed'}: give both the same --override-kv")
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


def slot_views(slots: list[Slot], ids: Sequence[int], tenant: str) -> list[SlotView]:
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


def cores_note(workers: Sequence[Worker], cores: int) -> str:
    """One line where this host's CPU workers compute with more threads than it has cores
    ("" where not): while two of them compute at once, llama.cpp's threads spin at its barriers
    for cores the other holds, and a step can take many times longer (two workers of two
    threads each on two cores: a short prompt waited 20 s for its first token beside another
    worker's answer, against under a second alone)."""
    cpu = [int(w.placement.get("threads", 0)) for w in workers
           if not w.remote and w.placement and not w.placement.get("gpu_layers")]
    if len(cpu) < 2 or sum(cpu) <= cores:
        return ""
    return (f"{len(cpu)} CPU workers of up to {max(cpu)} threads share {cores} cores: while "
            f"several compute, each waits for cores the others hold and a step can take many "
            f"times longer; serve sessions as --parallel slots of one worker, or give each "
            f"worker --threads and --threads-batch {max(cores // len(cpu), 1)}")
