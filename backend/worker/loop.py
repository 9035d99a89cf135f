"""The worker's threads: compute, reader, writer.

- **compute** (one, "llama"): the only thread that calls llama.cpp on the context. It takes the
  inputs that came (jobs, cancels, reads that finished), applies each to the core with the world
  as it is (`Core.apply`), does the effects in order (the compute ones through the runner, a
  result applied at once, before the next effect: the logits of a step are sampled before any
  other llama_decode), then asks the scheduler for the next step (`policies.schedule`), runs it
  and applies its results. It waits for input only when no slot has compute to do, and then
  says it rests (`resting`), which the writer waits for on a CPU. It hands each run's events to
  the HTTP thread in order (`send`), waking it only where `policies.schedule.wake_now` says
  (otherwise the HTTP thread takes them at its next beat).
- **reader** (one): reads, verifies and prepares the disk and shared entries a job starts from
  (`Tiers.read`), so a restore of gigabytes never holds up the other slots' steps; only the load
  itself (a copy into the context) runs on the compute thread.
- **writer** (one): writes queued snapshots to their files and publishes them
  (`Tiers.write`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from backend import keys
from backend.engine import Engine
from backend.protocol import Cancelled, Done, Error, Event, Job, Token
from backend.worker.core import Core
from backend.worker.messages import (
    Again,
    Arrive,
    CancelRun,
    Effect,
    Emit,
    Failed,
    Input,
    Live,
    Read,
    ReadDone,
    Snapshot,
    World,
)
from backend.worker.runner import Runner
from backend.worker.tiers import Tiers
from policies.preempt import HANDOVER_S
from policies.schedule import (
    Clock,
    Decode,
    Prefill,
    Shapes,
    Verify,
    charge,
    next_step,
    track,
    wake_now,
)

log = logging.getLogger("prefixgate.worker")


class Loop:
    def __init__(self, engine: Engine, core: Core, tiers: Tiers, shapes: Shapes,
                 send: Callable[[str, Event, bool], None]) -> None:
        self.engine, self.core, self.tiers, self.shapes = engine, core, tiers, shapes
        self.send = send  # (run id, event, wake the HTTP thread now)
        self.streaming: set[str] = set()  # runs whose first token went out
        self.quiet: set[str] = set()  # runs whose client does not stream (`Job.stream`)
        self.step_s = 0.0  # the last decode or verify step's seconds
        self.inbox: queue.SimpleQueue[Input | None] = queue.SimpleQueue()
        self.resting = threading.Event()  # set while no slot has compute to do
        self.resting.set()
        self.clock = Clock()
        # a preemption emptied a slot for a short request whose job comes next: no step
        # starts before a job does, or before this time (policies.preempt, HANDOVER_S; 0: none)
        self.handover_until = 0.0
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="reader")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="writer")
        self.runner = Runner(engine, tiers, self._write)
        self.thread = threading.Thread(target=self._main, name="llama", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, inp: Input) -> None:
        """From any thread: a job, a cancel, or a read that finished."""
        self.inbox.put(inp)

    def stop(self) -> None:
        """End the loop once the step it runs is done (jobs that wait are dropped), and wait
        for it: the engine may be closed then, never under a step."""
        self.inbox.put(None)
        if self.thread.is_alive():
            self.thread.join()
        self.reader.shutdown(wait=True)
        self.writer.shutdown(wait=True)

    # --- the compute thread ------------------------------------------------------------------

    def _world(self, full: bool = False) -> World:
        eng = self.engine
        slots = [Live(q.ids, q.n_live, q.exact_n, eng.floor(q.id),
                      eng.state_bytes(q.id) if full and q.exact_n else 0) for q in eng.seqs]
        held = self.tiers.held() if full else []
        self.runner.held = held if full else self.runner.held
        return World(slots, held, time.perf_counter())

    def _main(self) -> None:
        while True:
            world = self._world()
            tasks = self.core.tasks(world)
            while not tasks or not self.inbox.empty() or self.handover_until:  # wait for
                if not tasks:  # input when there is no compute; else take what came
                    self.resting.set()
                wait = max(self.handover_until - time.perf_counter(), 0.0) \
                    if tasks and self.handover_until else None
                try:
                    inp = self.inbox.get(timeout=wait)
                except queue.Empty:  # the short request's job did not come in time
                    log.debug("preempt: no job came within the hand-over")
                    self.handover_until = 0.0
                    break
                if inp is None:
                    self.resting.set()
                    return
                self.resting.clear()
                self._apply(inp)
                world = self._world()
                tasks = self.core.tasks(world)
            self.clock = track(self.clock, [(s, j.job.run_id, j.came_s)
                                            for s, j in self.core.jobs.items()],
                               tasks, world.now_s)
            step = next_step(tasks, self.clock, self.shapes, self.engine.n_batch, world.now_s)
            if step is None:
                continue
            if log.isEnabledFor(logging.DEBUG):
                log.debug("step %s of tasks %s (clock %s)", step, tasks, self.clock)
            try:
                results = self.runner.step(step, self.core)
            except Exception:  # a bug: the step's jobs fail, the loop (every other job) lives on
                log.exception("the worker failed on a step (%s)", type(step).__name__)
                slots = getattr(step, "slots", None) or (getattr(step, "slot", None),)
                results = [Failed(s, "the worker failed on this job (its log says why)")
                           for s in slots if isinstance(s, int) and s in self.core.jobs]
            if isinstance(step, Prefill):  # a prefill's memory may grow (llama.cpp's buffers)
                self.tiers.measure()
            seconds = max((r.seconds for r in results if hasattr(r, "seconds")), default=0.0)
            self.clock = charge(self.clock, step, seconds)
            if isinstance(step, Decode | Verify):
                self.step_s = seconds
            for r in results:
                self._apply(r)

    def _apply(self, inp: Input) -> None:
        """Apply an input and do its effects, each result applied at once (depth first)."""
        if isinstance(inp, Arrive) and not inp.job.stream:
            self.quiet.add(inp.job.run_id)
        if isinstance(inp, Arrive):  # the job the slot was given away for (or another: the
            self.handover_until = 0.0  # proxy's round trip is over either way)
        given = next((s for s, j in self.core.jobs.items() if j.job.run_id == inp.run_id),
                     None) if isinstance(inp, CancelRun) and inp.prefilling else None
        try:
            effects = self.core.apply(inp, self._world(full=isinstance(inp, Arrive) or (
                isinstance(inp, CancelRun) and inp.prefilling)  # its state's size counts
                or self.core.wakes_on(inp)))  # a job that follows may start from any of them
        except Exception:  # a bug: that job fails, the worker lives on
            log.exception("the worker's core failed on %s", type(inp).__name__)
            slot = getattr(inp, "slot", getattr(getattr(inp, "job", None), "slot", None))
            if isinstance(slot, int) and slot in self.core.jobs and not isinstance(inp, Failed):
                self._apply(Failed(slot, "the worker failed on this job (its log says why)"))
            return
        for e in effects:
            self._do(e)
        if given is not None and given not in self.core.jobs:  # it gave its slot away
            self.handover_until = time.perf_counter() + HANDOVER_S

    def _do(self, e: Effect) -> None:
        if isinstance(e, Emit):
            self._emit(e.run_id, e.event)
        elif isinstance(e, Read):
            self.reader.submit(self._read, e)
        elif isinstance(e, Again):  # applied before the next step (the inbox is not empty)
            self.submit(Arrive(dataclasses.replace(e.job, nest=False)))
        else:
            try:
                result = self.runner.effect(e, self.core)
            except Exception as ex:  # llama.cpp refused something: that job fails
                log.exception("the worker failed on %s", type(e).__name__)
                slot = getattr(e, "slot", None)
                result = Failed(slot, f"{type(ex).__name__}: {ex}") if isinstance(
                    slot, int) and slot in self.core.jobs else None
            if result is not None:
                self._apply(result)

    def _emit(self, run_id: str, event: Event) -> None:
        first = isinstance(event, Token) and run_id not in self.streaming
        if first:
            self.streaming.add(run_id)
        streamed = run_id not in self.quiet
        if isinstance(event, Done | Cancelled | Error):
            self.streaming.discard(run_id)
            self.quiet.discard(run_id)
        self.send(run_id, event, wake_now(isinstance(event, Token), first, self.step_s,
                                          streamed))

    # --- the reader and writer threads -------------------------------------------------------

    def _read(self, e: Read) -> None:
        r = e.job.plan.restore[e.index]
        payload, fault, pulled, seconds = self.tiers.read(e.job, r)
        self.submit(ReadDone(e.slot, e.run_id, e.index, payload, seconds, fault, pulled))

    def _write(self, run_id: str, key: keys.CacheKey, e: Snapshot, ids: tuple[int, ...],
               state: memoryview, tenant: str) -> None:
        self.writer.submit(self.tiers.write, run_id, e.save, key, ids, state, tenant,
                           time.monotonic())

    def arrive(self, job: Job) -> None:
        self.submit(Arrive(job))

    def cancel(self, run_id: str, prefilling: bool = False) -> None:
        self.submit(CancelRun(run_id, prefilling))

    def stats(self) -> dict[str, Any]:
        return self.tiers.stats()
