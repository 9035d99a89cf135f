"""The worker's HTTP shell (Unix socket, or TCP across containers): the protocol of
backend/protocol.py over the compute loop.

    GET  /health  -> WorkerInfo (while it loads: 503 {"status": "loading", ...}, `Boot`)
    POST /run     -> a Job in, its NDJSON event stream out (a malformed job is a 400, a job for
                     a slot that is running one a 409)
    POST /cancel  -> {"run_id", "prefilling"?}: stop that run at once (its stream reports
                     `Cancelled`); with "prefilling": true only if it has not sampled yet
    GET  /events  -> NDJSON of TierEvent: the RAM tier's entries as they are, then every change;
                     `?all=1`: every tier's (each slot's live KV, the shared tier's publishes too:
                     a KV-aware router's feed, computed only while someone asks for it)

`Done` comes as soon as generation ends (the slot is free then); `Saved` events follow once
each file is durable, and the stream ends after the last one. The client closing the stream
cancels the run; nothing more is written to it then.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from aiohttp import web

from backend import volume
from backend.engine import Engine
from backend.keys import CacheIdentity
from backend.protocol import (
    Cancelled,
    DecodeInfo,
    Done,
    Error,
    Event,
    Identity,
    Job,
    Saved,
    SaveFailed,
    TierEvent,
    WorkerInfo,
    encode_event,
)
from backend.worker.core import Core
from backend.worker.loop import Loop
from backend.worker.tiers import Tiers
from backend.worker.verify import report
from policies.costs import Fit
from policies.schedule import STREAM_S

WATCH_S = 0.05  # how often a stream checks that its client is still there


@dataclass(slots=True)
class _Run:
    slot: int
    stream: bool  # its client reads the answer as it comes (the beat delivers its tokens)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)


class Worker:
    def __init__(self, engine: Engine, core: Core, tiers: Tiers, decode: DecodeInfo,
                 worker_id: int, cache_dir: Path, identity: CacheIdentity, n_ctx: int,
                 checked: dict[str, Any]) -> None:
        self.engine, self.core, self.tiers, self.decode = engine, core, tiers, decode
        self.worker_id, self.cache_dir, self.identity = worker_id, cache_dir, identity
        self.fingerprint = identity.fingerprint()
        self.n_ctx, self.checked = n_ctx, checked  # as configured, all slots
        self.boot_id = uuid.uuid4().hex  # new on every start: the proxy detects a restart
        self.runs: dict[str, _Run] = {}  # streaming runs
        self.active: dict[int, str] = {}  # slot -> the run it serves, until it ends
        self.nests: dict[int, str] = {}  # slot -> the job nested on its run (`Job.nest`)
        self.listeners: dict[asyncio.Queue[TierEvent | None], bool] = {}  # -> wants every tier
        self.closing = False  # the server stops: event streams end (`close_streams`)
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.loop: Loop | None = None
        # events from the compute thread, in order, until this thread delivers them
        self.outbox: collections.deque[tuple[str, Event]] = collections.deque()
        self.beat: asyncio.Task[None] | None = None  # delivers them while runs stream

    def start(self, shapes: Any) -> None:
        """Serve: the compute loop starts (events reach this event loop from its threads)."""
        self.aloop = asyncio.get_running_loop()
        self.tiers.emit = self.emit
        self.tiers.on_event = self.tier_event
        self.loop = Loop(self.engine, self.core, self.tiers, shapes, self.send)
        self.loop.start()

    # --- from the worker's threads -----------------------------------------------------------

    def emit(self, run_id: str, event: Event) -> None:
        self.send(run_id, event, True)

    def send(self, run_id: str, event: Event, wake: bool) -> None:
        """A run's event to its stream, after those sent before it: now (`wake`), or at the
        HTTP thread's next beat (`policies.schedule.wake_now`)."""
        assert self.aloop is not None
        self.outbox.append((run_id, event))
        if wake:
            self.aloop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        while self.outbox:
            run_id, event = self.outbox.popleft()
            run = self.runs.get(run_id)
            if run is None:
                continue
            if isinstance(event, Done | Cancelled | Error):
                for taken in (self.active, self.nests):
                    if taken.get(run.slot) == run_id:
                        del taken[run.slot]  # the slot takes a new job from now on
            run.events.put_nowait(event)

    async def _beat(self) -> None:
        """While runs stream: their events that did not wake this thread (a run that does not
        stream has its tokens taken with its end: `policies.schedule.wake_now`)."""
        while any(r.stream for r in self.runs.values()):
            await asyncio.sleep(STREAM_S)
            self._deliver()
        self.beat = None

    def tier_event(self, event: TierEvent) -> None:
        assert self.aloop is not None
        self.aloop.call_soon_threadsafe(self._broadcast, event)

    def _broadcast(self, event: TierEvent) -> None:
        for q, every in self.listeners.items():
            if every or event.tier == "ram":
                q.put_nowait(event)

    def close_streams(self) -> None:
        """The server stops: every event stream ends now. aiohttp waits for its handlers before
        the process exits, and a stream that only polled would hold each stop (and each
        restart) for up to a second."""
        self.closing = True
        for q in self.listeners:
            q.put_nowait(None)

    # --- HTTP --------------------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        eng, mem, stats = self.engine, self.engine.memory, self.tiers.stats()
        return WorkerInfo(
            worker_id=self.worker_id, pid=os.getpid(), boot_id=self.boot_id,
            model=self.identity.model_path, fingerprint=self.fingerprint.hex(),
            llama_cpp_version=llama_cpp.__version__, flash_attn=eng.flash_attn,
            compute=eng.compute, n_ctx=self.n_ctx, n_ctx_actual=eng.n_ctx,
            slots=len(eng.seqs), n_live=tuple(q.n_live for q in eng.seqs),
            busy=tuple(s in self.active for s in range(len(eng.seqs))), memory=mem.kind,
            n_swa=mem.n_swa, swa_full=mem.full, align=eng.batching.size,
            batch_ends=tuple(sorted(eng.batching.ends)), exact=self.core.exact,
            exact_failure=str(self.checked.get("failure", "")),
            borrows=self.core.exact and self.core.cuts and self.tiers.ram.on,
            decode=self.decode, threads=eng.n_threads, threads_batch=eng.n_threads_batch,
            cache_volume=volume.read(self.cache_dir), costs=self.core.costs.to_wire(),
            cache_ram=dict(stats["ram"]), shared=stats["shared"], writes={
                **stats["writes"], "at_rest_on": float(self.tiers.at_rest is not None)},
            borrowed=dict(self.core.borrowed), placement=dict(eng.placement),
            checked=self.checked, identity=Identity(**asdict(self.identity)),
            speculation=report(self.core.spec, self.core,
                               self.loop.runner.step_rows if self.loop else Fit()))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(self.info().to_wire())

    async def run(self, request: web.Request) -> web.StreamResponse:
        try:
            job = Job.decode(await request.read())
        except ValueError as e:  # a proxy of another version, or a bug: say what is wrong
            return web.json_response({"error": str(e)}, status=400)
        slots = len(self.engine.seqs)
        if job.slot >= slots:
            return web.json_response({"error": f"slot {job.slot}: this worker has {slots} "
                                               "(--parallel)"}, status=400)
        # one job per slot, and one nested on its run (two proxies, or a proxy's bug)
        taken = self.nests if job.nest and job.slot in self.active else self.active
        if job.slot in taken or job.slot in self.nests:
            return web.json_response({"error": f"slot {job.slot} is running a job"},
                                     status=409)
        assert self.loop is not None
        run = self.runs[job.run_id] = _Run(job.slot, job.stream)
        taken[job.slot] = job.run_id
        try:
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
        except BaseException:
            taken.pop(job.slot, None)
            self.runs.pop(job.run_id, None)
            raise
        if self.beat is None and job.stream:
            self.beat = asyncio.create_task(self._beat())
        self.loop.arrive(job)
        watch = asyncio.create_task(self._watch(request, job.run_id))
        gone = False  # the proxy closed the stream: nothing more is written
        try:
            saves_seen, expected = 0, None  # `expected`: saves announced by done or cancelled
            while expected is None or saves_seen < expected:
                events = [await run.events.get()]
                while True:  # with those that came with it: one write
                    event = events[-1]
                    if isinstance(event, Done | Cancelled):
                        expected = event.pending_saves
                    elif isinstance(event, Saved | SaveFailed):
                        saves_seen += 1
                    elif isinstance(event, Error):
                        expected = saves_seen  # a failed run's pending writes are not awaited
                    if (expected is not None and saves_seen >= expected) or run.events.empty():
                        break
                    events.append(run.events.get_nowait())
                gone = gone or request.transport is None or request.transport.is_closing()
                if not gone:
                    try:
                        await resp.write(b"".join(map(encode_event, events)))
                    except (ConnectionError, RuntimeError):
                        gone = True
                        self.loop.cancel(job.run_id)
        finally:
            watch.cancel()
            if job.run_id in (self.active.get(job.slot), self.nests.get(job.slot)):
                self.loop.cancel(job.run_id)  # still running: it stops at once
            self.runs.pop(job.run_id, None)
        with contextlib.suppress(ConnectionError):  # the proxy may close once it has `done`
            await resp.write_eof()
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        """Stop a run now; its stream goes on to report what is live and the snapshots still
        being written."""
        body = await request.json()
        run_id = str(body.get("run_id")) if isinstance(body, dict) else ""
        run = self.runs.get(run_id)
        if run is None or run_id not in (self.active.get(run.slot), self.nests.get(run.slot)) \
                or self.loop is None:
            return web.json_response({"cancelled": False}, status=404)
        self.loop.cancel(run_id, body.get("prefilling") is True)
        return web.json_response({"cancelled": True})

    async def events(self, request: web.Request) -> web.StreamResponse:
        """The RAM tier's entries as they are, then every tier event, until the client goes."""
        q: asyncio.Queue[TierEvent | None] = asyncio.Queue()
        every = request.query.get("all") == "1"
        self.listeners[q] = every
        self.tiers.every = any(self.listeners.values())
        try:
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            for k, e in list(self.tiers.ram.entries.items()):
                await resp.write(encode_event(TierEvent("stored", "ram", k, e.salt.hex(),
                                                        e.tenant, len(e.ids),
                                                        tuple(int(t) for t in e.ids))))
            for ev in list(self.tiers.live.values()) if every else []:  # each slot's live KV
                await resp.write(encode_event(ev))
            while request.transport is not None and not request.transport.is_closing() \
                    and not self.closing:
                try:  # a client that is gone is noticed without an event to write
                    event = await asyncio.wait_for(q.get(), WATCH_S * 20)
                except asyncio.TimeoutError:
                    continue
                if event is None:  # close_streams
                    break
                await resp.write(encode_event(event))
        except (ConnectionError, RuntimeError):
            pass
        finally:
            self.listeners.pop(q, None)
            self.tiers.every = any(self.listeners.values())
        return resp

    async def _watch(self, request: web.Request, run_id: str) -> None:
        while run_id in self.runs:
            if request.transport is None or request.transport.is_closing():
                if self.loop is not None:
                    self.loop.cancel(run_id)
                return
            await asyncio.sleep(WATCH_S)
