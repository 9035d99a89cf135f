"""The worker process: one Engine behind a small HTTP API (Unix socket, or TCP across containers).

    GET  /health  -> {"ready", "worker_id", "n_ctx" (as configured, all slots), "n_ctx_actual"
                      (one slot's, padded by llama.cpp), "slots" (how many), "n_live" (per
                      slot), "busy" (per slot), "cache_ram" (the RAM tier's use and counts),
                      "fingerprint", "model", "pid",
                      "boot_id" (new each start), "flash_attn", "llama_cpp_version", "compute"
                      (the devices that compute the KV: in the fingerprint, backend.keys),
                      "memory" ({"kind": plain | window | recurrent, "n_swa"}),
                      "align" (the batch size), "batch_ends" (the end-of-turn ids where a
                      batch may end early: policies.prefix.Batching; reuse only at edges),
                     "exact" (the start-up self-check: {"ok", "checked", "failure", ...}),
                      "cache_volume" (the id in its --cache-dir, backend/volume.py),
                      "placement" (backend, GPU layers, VRAM and RAM of weights and KV)}
                  while it loads: 503 {"status": "loading", "phase", "progress"} (`Boot`)
    POST /run     -> a `backend.protocol.Job` in, its NDJSON event stream out (the events and
                     their order are in backend/protocol.py; a malformed job is a 400, a job
                     for a slot that is running one a 409)
    POST /cancel  -> {"run_id"}: stop that run at its next prefill batch or token

A job carries its `policies.decide.Plan`: the entries to restore (longest first: a broken file
is reported in `Start.faults` and the next one tried), the save points, `keep_max` (reuse at most
this many tokens) and `live_ok` (false: the live KV is another tenant's and is not reused). The
worker executes it as it is; it decides nothing and has no defaults.

Slots (`--parallel N`): the engine holds one sequence per slot, and a job names its slot (the
proxy routes). Each slot has its own live ids, tenant and cancellation. All llama calls run on
one thread, the scheduler's, which runs the slots' jobs one step at a time: a prefill batch,
or one generated token (evaluated, then the next one sampled) (`Scheduler`): the prefill due
first, the prefills as one sharing the thread's time with each slot that generates. A short
prompt therefore does not wait behind a long one, a long prefill never starves a slot that is
generating, nor does it slow that slot's answer to one token per prefill batch. Every prefill
batch holds one sequence's tokens only, in the cold run's batches, and decode steps of several
slots share a llama_decode only as the start-up check proved (`Engine.decode`): as they come
where each slot's logits equal its own alone, in a fixed shape (a row per slot) where they do
not depend on the other rows: each slot computes exactly what it would alone, whatever else
generates (the exactness rules of backend/engine.py; bench/results/issue20/decode_batch.md).
State files are written on another thread, after the state was copied in memory, so a save
never delays the first token.
Where llama.cpp computes on the CPU that thread first waits for the llama thread to rest
(`_await_rest`: WRITE_REST_S at most, and not while WRITE_REST_BYTES wait): on a few cores its
hashing and writing slowed every prefill it overlapped (bench/results/issue20). Meanwhile the
proxy's index does not know the state, so a job whose prompt starts with one that waits restores
it from memory (`_from_memory`, counted as a RAM hit): a subagent arriving while the main
session prefills still reuses the prefix they share. A prompt that shares only part of a state
in memory (another slot's live KV, a RAM-tier entry, a waiting state) gets a copy of it cut back
to the last batch edge both share, where the memory can be cut back (`_from_memory` too).

The RAM tier (`backend.ramtier`, `--cache-ram`): when a job would replace a slot's live KV, the
part of it a next request could reuse is copied to host RAM first; a job restores from there
when that is at least as long as its plan's longest disk entry. `Done` comes as soon as
generation ends (the worker is free then); `Saved` events follow once each file is durable, and
the stream ends after the last one.

Cancelling: `/cancel` stops the run; its stream then reports `Cancelled` (what is live: the
prefilled tokens stay, a retry reuses them) and goes on with the `Saved` events of snapshots
already taken, so the proxy can still commit them. The client closing the stream also cancels
the run; nothing more is written then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from aiohttp import web

from backend import keys, selfcheck, store, volume
from backend.engine import Cancel, Cancelled, Engine, Sampling, StopMatcher
from backend.protocol import Cancelled as CancelledEvent
from backend.protocol import (
    Done,
    Error,
    Event,
    Fault,
    Job,
    Prefill,
    Saved,
    SaveFailed,
    Start,
    Token,
    encode_event,
    placement_note,
)
from backend.ramtier import RamTier
from backend.shared import SHARED_PREFIX, STATS, SharedFault, SharedTier
from policies.costs import Costs, pays
from policies.decide import Save
from policies.prefix import Edges

log = logging.getLogger("prefixgate.worker")

Emit = Callable[[Event], None]


@dataclass(slots=True)
class _SlotJob:
    """A slot's job as the HTTP side sees it: `ended` once it has said done, cancelled or
    error (its last step is then returning), `future` done once its steps have stopped."""

    future: asyncio.Future[None] | None = None
    ended: bool = False

    def done(self) -> bool:
        return self.future is None or self.future.done()


@dataclass(frozen=True, slots=True)
class _Queued:
    """A snapshot waiting for its file (`Worker._write`): restorable from memory meanwhile."""

    salt: bytes
    tenant: str
    ids: np.ndarray  # exactly the tokens its state holds
    state: memoryview


# a job: each `next()` one step, yielding what `_Task.left` says, or DECODE: its slot's
# generated token waits to be evaluated (`Engine.decode_next`) before its next step
DECODE = "decode"
Step = Iterator[int | str | None]
NOMINAL_TOKEN_S = 0.001  # a prefilled token's seconds until the scheduler has measured one


@dataclass(slots=True)
class _Task:
    slot: int
    steps: Step
    cancel: Cancel | None = None
    done: Future[None] = field(default_factory=Future)
    used: float = 0.0  # seconds its steps took, counted from the least of the others' at its start
    left: int | None = None  # prompt tokens its prefill has left, None where it does not prefill
    began: float = 0.0  # when its prefill began (perf_counter)
    total: int = 0  # the tokens its prefill had then
    waits: bool = False  # it yielded DECODE: its token is evaluated before its next step


class Scheduler:
    """Runs the slots' jobs on one thread, one step at a time (module docstring).

    The jobs that prefill are served as one, the one due first running its batch (the others
    wait): a prefill is due when it would end had it run alone from its start (its tokens at
    the seconds a prefilled token has taken lately, the same for all; a job says what it has
    left by the value of each step, `_Task.left`). Ends of prefills are what clients wait
    for. Beside a long prompt a short one is due first and ends almost as soon as alone: a
    title request's 200 tokens no longer wait behind a subagent's 2,000 (llama-server fills
    each batch with every waiting prompt's tokens in turn, so a short prompt ends in its first
    batch there too). A prompt's due time moves only with that measure, so short prompts
    arriving one after another hold a long one back only until it is due, after which it comes
    first (no prompt waits without end), and two prompts never take turns batch by batch.

    The prefills, as one, and each job that generates then share the thread's time, not its
    turns: the one that has used the least time runs its step. On a CPU a prefill batch costs
    ten or more generated tokens, so turns would let an answer crawl at one token per batch;
    shared time lets it run a token per step while the batches take their share. A job or the
    prefills start level with the least of the others (never owed their past), a job that ends
    its prefill carries on from the prefills' count, and ties go to the earlier job, the
    prefills last (a job's first step, which says what it has to prefill, comes first). A
    cancelled job runs its step first (it stops there). The engine is switched to a job's slot
    before each of its steps.

    A generating job's step samples a token and yields DECODE; the token is evaluated when the
    job's turn comes, and where the engine may batch decode steps (`Engine.decode`) in one
    llama_decode with the tokens of every other job that waits so: each of them is charged the
    call's time and then samples its next token, before any other llama_decode (which would
    replace their logits)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self.resting = threading.Event()  # set while no slot has a step to run
        self.resting.set()
        self.prefills_used = 0.0  # the time the prefills have used, as one (`used`)
        self.per_token = 0.0  # seconds a prefilled token has taken lately (0: not known yet)
        self.thread = threading.Thread(target=self._loop, name="llama", daemon=True)
        self.thread.start()

    def submit(self, slot: int, steps: Step, cancel: Cancel | None = None) -> Future[None]:
        task = _Task(slot, steps, cancel)
        self.inbox.put(task)
        return task.done

    def stop(self) -> None:
        """End the loop once the step it runs is done (jobs that wait are dropped), and wait
        for it: the engine may be closed then, never under a step."""
        self.inbox.put(None)
        self.thread.join()

    def _least(self, tasks: list[_Task]) -> float:
        """The least time used by the prefills (if any) and the jobs that do not prefill."""
        used = [t.used for t in tasks if t.left is None]
        if any(t.left is not None for t in tasks):
            used.append(self.prefills_used)
        return min(used, default=0.0)

    def _pick(self, tasks: list[_Task]) -> _Task:
        stopping = next((t for t in tasks if t.cancel is not None and t.cancel.is_set), None)
        if stopping is not None:
            return stopping
        rest = [t for t in tasks if t.left is None]
        other = min(rest, key=attrgetter("used"), default=None)  # the first of the least used
        prefills = [t for t in tasks if t.left is not None]
        if prefills and (other is None or self.prefills_used < other.used):
            s = self.per_token or NOMINAL_TOKEN_S
            return min(prefills, key=lambda t: t.began + t.total * s)  # the first due
        assert other is not None
        return other

    def _loop(self) -> None:
        tasks: list[_Task] = []  # in the order they came
        while True:
            try:  # wait for work when there is none; otherwise take what came, without waiting
                while True:
                    if not tasks:
                        self.resting.set()
                    new = self.inbox.get(block=not tasks)
                    if new is None:
                        self.resting.set()
                        return
                    self.resting.clear()
                    new.used = self._least(tasks)
                    tasks.append(new)
            except queue.Empty:
                pass
            task = self._pick(tasks)
            if task.waits and not (task.cancel is not None and task.cancel.is_set):
                self._decode(tasks, task)
            else:
                self._step(tasks, task)

    def _decode(self, tasks: list[_Task], task: _Task) -> None:
        """Evaluate the token `task` waits with, beside every other waiting one's where the
        engine batches decode steps; then each of them takes its next step (it samples)."""
        group = [task]
        if self.engine.decode != "apart":
            group += [t for t in tasks if t.waits and t is not task
                      and not (t.cancel is not None and t.cancel.is_set)]
        t = time.perf_counter()
        try:
            self.engine.decode_next([g.slot for g in group])
        except Exception as e:  # each job's own wrapper reports it
            for g in group:
                g.waits = False
                self._step(tasks, g, e)
            return
        dt = time.perf_counter() - t
        for g in group:
            g.used += dt
            g.waits = False
            self._step(tasks, g)

    def _step(self, tasks: list[_Task], task: _Task, error: Exception | None = None) -> None:
        """Run the task's next step (raise `error` into it instead, where given)."""
        self.engine.use(task.slot)
        t = time.perf_counter()
        try:
            value = next(task.steps) if error is None else task.steps.throw(error)
        except StopIteration:
            tasks.remove(task)
            task.done.set_result(None)
            return
        except BaseException as e:  # the job's own wrapper reports it; never the loop's end
            tasks.remove(task)
            task.done.set_exception(e)
            return
        dt = time.perf_counter() - t
        task.waits = value == DECODE
        left = value if isinstance(value, int) else None
        if task.left is not None:
            self.prefills_used += dt
            done = task.left - (left or 0)
            if done > 0:
                self.per_token = dt / done if not self.per_token else \
                    0.7 * self.per_token + 0.3 * dt / done
        else:
            task.used += dt
        if left is not None and task.left is None:  # it begins to prefill
            if all(t.left is None for t in tasks):  # the prefills start level
                self.prefills_used = self._least(tasks)
            task.began, task.total = time.perf_counter(), left
        elif left is None and task.left is not None:  # its prefill ended
            task.used = self.prefills_used
        task.left = left


class Worker:
    def __init__(self, engine: Engine, worker_id: int, cache_dir: Path, fingerprint: bytes,
                 model_path: str, n_ctx: int = 0,
                 ram: RamTier | None = None) -> None:
        self.engine = engine
        self.slots = len(engine.seqs)
        self.ram = ram if ram is not None else RamTier(0)
        self.n_ctx = n_ctx or engine.n_ctx  # as configured; llama.cpp may pad it up
        self.worker_id = worker_id
        self.cache_dir = cache_dir
        self.fingerprint = fingerprint
        self.model_path = model_path
        self.boot_id = uuid.uuid4().hex  # new on every start: the proxy detects a restart
        self.scheduler: Scheduler | None = None  # started once the self-check is done (`start`)
        self.writer_thread = ThreadPoolExecutor(1, thread_name_prefix="writer")
        # where llama.cpp computes on the CPU, a state file is written while the llama thread
        # rests (WRITE_REST_S at most later, and never with more than WRITE_REST_BYTES
        # waiting): the writer's copy and hash would take cores from a prefill otherwise
        self.write_at_rest = engine.placement.get("gpu_layers") == 0
        self.writes = {"queued_bytes": 0, "at_rest": 0, "rest_waited_s": 0.0}
        self.queued: dict[bytes, _Queued] = {}  # key -> a state whose file is not written yet
        self.writes_lock = threading.Lock()
        self.runs: dict[str, Cancel] = {}  # run id -> its cancel flag, while it streams
        self.jobs: dict[int, _SlotJob] = {}  # each slot's latest job
        # per slot, whose prompt the live KV holds (tenant, cache salt): a job of another
        # tenant never keeps any of it, whatever its plan says (the proxy's view of a worker
        # can be stale after a failure); the salt keys it in the RAM tier when it gives way
        self.owners = [""] * self.slots
        self.salts = [b""] * self.slots
        # the start-up self-check's verdict (`exactness`); not ok: nothing is reused, whatever a
        # plan says
        self.exact: dict[str, object] = {"ok": True, "checked": False, "failure": ""}
        # what prefill and restores cost here, measured as it runs (policies.costs): the
        # proxy's decide restores only what pays, this worker's RAM tier likewise
        self.costs = Costs()
        # the shared snapshot tier (backend.shared, --shared-tier), and what it did
        self.shared: SharedTier | None = None
        self.shared_stats: dict[str, float] = dict.fromkeys(STATS, 0)
        # states this prompt shared only part of, cut back from another slot, the RAM tier or a
        # state waiting for its file (`_from_memory`): how many from each, and the tokens kept
        self.borrowed = dict.fromkeys(("slot", "ram", "queued", "tokens"), 0)

    def start(self) -> None:
        self.scheduler = Scheduler(self.engine)

    # --- runs on the llama thread ----------------------------------------------------------

    def _give_way(self, slot: int, keep: int, job: Job, ids: np.ndarray) -> None:
        """Before a job keeps only `keep` tokens of the slot's live KV: the part a next request
        could reuse goes to the RAM tier (cut back to a batch edge first), unless this prompt
        extends all of it (then only its last batch is evaluated again)."""
        eng = self.engine
        if not self.ram.on or not self.exact["ok"]:
            return
        n = eng.reusable()[0]
        if n > keep:
            n = eng.batching.edges(eng.ids[:n].tolist()).floor(n)
        if n <= keep or (self.owners[slot] == job.tenant and len(ids) >= n
                         and np.array_equal(eng.ids[:n], ids[:n])):
            return
        if eng.truncate(n) != n:
            return
        self.ram.put(self.salts[slot], self.owners[slot], eng.ids[:n].copy(), eng.snapshot())

    def steps(self, job: Job, emit: Emit, cancel: Cancel) -> Step:
        """The job, one step per `next()` (the scheduler runs other slots' steps between),
        each yielding the prompt tokens its prefill has left (`Scheduler`)."""
        eng, plan, ids, slot = self.engine, job.plan, list(job.ids), job.slot
        t0 = time.perf_counter()
        # at most the last batch edge before the last token (policies.prefix.keep_max; a plan
        # of a proxy that thought otherwise is held to it), and lower when a scope boundary
        # that reuse passed must still be snapshotted
        exact = bool(self.exact["ok"])
        edges = eng.batching.edges(ids)
        last = min(plan.keep_max, edges.keep_max) if exact else 0

        mine = plan.live_ok and job.tenant == self.owners[slot] and exact

        def live() -> int:  # what the live KV holds of this prompt that may be kept
            return min(eng.live_prefix(ids, edges), last) if mine else 0

        keep, restored, from_ram, faults = live(), 0, 0, []
        ids_np = np.asarray(ids, dtype=np.intc)
        self._give_way(slot, keep, job, ids_np)
        disk = max((r.n_tokens for r in plan.restore if r.n_tokens in edges), default=0)
        # from memory where that holds more than the live KV and at least the plan's disk entry
        if exact:
            n = self._from_memory(slot, job, ids_np, edges, last, keep, max(keep + 1, disk))
            if n:
                from_ram = keep = n
            elif eng.n_live < keep:  # a restore began and failed, or a cut was refused
                keep = live()
        pulled: list[Saved] = []  # entries pulled from the shared tier: local entries now
        for r in plan.restore if exact and not from_ram else ():  # longest first
            if r.n_tokens <= keep:
                break
            if r.n_tokens not in edges:  # never a hit the cold run's batches cannot replay
                continue
            try:
                t = time.perf_counter()
                if self.engine.fault == "slow-disk":  # a test's injected fault: a slow disk
                    time.sleep(SLOW_DISK_S)
                file = r.file
                if file.startswith(SHARED_PREFIX):
                    file = self._pull(r.key, r.n_tokens, job.tenant, pulled)
                n, state = store.read_state_file(self.cache_dir / file, self.fingerprint, ids)
                if n != r.n_tokens:
                    raise store.CacheFault("tokens", f"file holds {n} tokens, index said "
                                                     f"{r.n_tokens}")
                eng.restore(ids[:n], state)
                self.costs = self.costs.add_restore("disk", len(state),
                                                    time.perf_counter() - t)
                restored, keep = n, min(n, last)
                break
            except store.CacheFault as e:
                faults.append(Fault(e.reason, str(e), r.file))
                if r.file.startswith(SHARED_PREFIX) and pulled:  # verified: not kept locally
                    self.shared_stats["verify_failures"] += 1
                    with contextlib.suppress(OSError):
                        (self.cache_dir / pulled.pop().file).unlink()
            except SharedFault as e:
                faults.append(Fault("missing", f"shared tier: {e}", r.file))
            except ValueError as e:
                faults.append(Fault("corrupt", str(e), r.file))
            keep = live()  # a failed restore may have cleared the live KV
        keep = eng.truncate(keep)  # what the memory refuses to keep is prefilled again
        # from here on the KV holds (a prefix of) this prompt
        self.owners[slot], self.salts[slot] = job.tenant, job.salt
        emit(Start(keep, restored, time.perf_counter() - t0, tuple(faults), from_ram))
        pending: list[Future[None]] = []
        for saved in pulled:  # a pulled file is a local entry now: the proxy commits it
            emit(saved)
            done: Future[None] = Future()
            done.set_result(None)
            pending.append(done)
        yield len(ids) - eng.n_live

        saves = {s.n_tokens: s for s in plan.saves if exact and s.n_tokens in edges}

        def write(p: int, state: memoryview) -> None:
            key = keys.prefix_keys(job.salt, ids, [p])[p]
            with self.writes_lock:
                if bytes(key) in self.queued:  # this very state already waits for its file (a
                    return  # plan made before the index had it): written once
                self.writes["queued_bytes"] += state.nbytes
                self.queued[bytes(key)] = _Queued(job.salt, job.tenant, ids_np[:p].copy(), state)
            pending.append(self.writer_thread.submit(self._write, saves[p], key, ids[:p], state,
                                                     emit, job.tenant, time.monotonic()))

        # behind the reuse: copied from the live KV, where the memory can be cut back there
        for p in sorted(p for p in saves if p < eng.n_live and eng.can_snapshot_behind(p)):
            write(p, eng.snapshot_behind(p))
        try:
            start = eng.n_live
            busy = yield from eng.prefill_steps(ids, [p for p in saves if p >= eng.n_live],
                                                lambda p: write(p, eng.snapshot()), cancel,
                                                lambda n: emit(Prefill(n)), edges)
            self.costs = self.costs.add_prefill(start, len(ids), busy)
            yield from self._generate(job, emit, cancel, t0, pending)
        except Cancelled:  # what it prefilled stays live; snapshots taken are still written
            emit(CancelledEvent(*eng.reusable(), len(pending)))

    def _generate(self, job: Job, emit: Emit, cancel: Cancel, t0: float,
                  pending: list[Future[None]]) -> Step:
        eng = self.engine
        t1 = time.perf_counter()
        sampling = Sampling.from_json(job.sampling)
        matcher = StopMatcher(job.stop)
        finish, matched, n_gen = "length", None, 0
        grammar = job.grammar or None
        for step in eng.generate_steps(sampling, job.max_tokens, cancel, grammar):
            if step is None:  # its token is evaluated (beside other slots') before the next
                yield DECODE
                continue
            token, piece, eog = step
            if eog:
                finish = "stop"
                break
            n_gen += 1
            text, matched = matcher.feed(piece)
            emit(Token(token, text))
            if matched is not None:
                finish = "stop_sequence"
                break
        tail = matcher.flush() if matched is None else ""
        if tail:
            emit(Token(None, tail))
        emit(Done(finish, matched, n_gen, *eng.reusable(), t1 - t0, time.perf_counter() - t1,
                  len(pending), self.costs.to_wire()))

    def _pull(self, key: bytes, n_tokens: int, tenant: str, pulled: list[Saved]) -> str:
        """A shared entry pulled into the local tier (raises SharedFault): its file, which the
        caller verifies as any other; its `Saved` (reason "shared") is kept for the proxy."""
        if self.shared is None:
            raise SharedFault("this worker has no --shared-tier")
        t = time.perf_counter()
        path = store.state_path(self.cache_dir, keys.CacheKey(key))
        size = self.shared.pull(key, tenant, path)
        self.shared_stats["pulls"] += 1
        self.shared_stats["pulled_bytes"] += size
        self.shared_stats["pull_s"] += time.perf_counter() - t
        file = str(path.relative_to(self.cache_dir))
        pulled.append(Saved(n_tokens, key.hex(), "shared", file, size,
                            store.read_header(path).checksum, time.perf_counter() - t))
        return file

    # --- runs on the writer thread ---------------------------------------------------------

    def _write(self, save: Save, key: keys.CacheKey, ids: list[int], state: memoryview,
               emit: Emit, tenant: str, queued: float) -> None:
        self._await_rest(queued)
        t0 = time.perf_counter()
        try:
            path, size, checksum = store.write_state_file(
                self.cache_dir, key, self.fingerprint, ids, state
            )
        except store.CacheFault as e:
            emit(SaveFailed(len(ids), key.hex(), save.reason, e.reason, str(e)))
            return
        finally:  # written (the proxy commits it now) or failed: no longer restored from here
            with self.writes_lock:
                self.writes["queued_bytes"] -= state.nbytes
                self.queued.pop(bytes(key), None)
        emit(Saved(len(ids), key.hex(), save.reason, str(path.relative_to(self.cache_dir)),
                   size, checksum, time.perf_counter() - t0))
        if self.shared is not None:  # after the local commit: the shared tier is the extra
            try:
                self.shared_stats["published_bytes"] += self.shared.publish(
                    key, tenant, len(ids), checksum, path)
            except SharedFault as e:
                self.shared_stats["publish_failures"] += 1
                log.warning("shared tier: a snapshot of %d tokens not published: %s",
                            len(ids), e)

    def _from_memory(self, slot: int, job: Job, ids: np.ndarray, edges: Edges, limit: int,
                     keep: int, at_least: int) -> int:
        """The longest batch edge of this prompt (between `at_least` and `limit`) up to which a
        state in this worker's memory holds the same tokens, loaded into the slot and, where
        the state goes on past it, cut back there (what llama-server does with its slots and
        prompt cache, kept exact). The states, of this salt and tenant: the RAM tier's entries,
        states waiting for their files (the proxy's index lacks them until written) and other
        slots' live KV (its exact part; copied, that slot keeps it). A RAM entry the prompt
        wholly starts with leaves the tier (the slot holds it now); one cut back stays.
        Exact by the engine's rules: an edge that both prompts' tokens share is an edge of
        both, so below it the state holds the cold run's batches. A cut, and a copy of a live
        slot, only where the memory can be cut back to any position (plain attention; a
        window's restore pads cells a cut cannot pass, a recurrent state has no past) and the
        RAM tier is on; a live slot's copy passes through host RAM, so none larger than its
        budget. Only where it pays (`pays`, on the whole state's bytes, twice for a live
        slot's: copied out, then in). Ties: a whole state before a cut one. Returns the tokens
        kept (0: nothing was loaded, or a restore failed or a cut was refused: the slot then
        holds none)."""
        eng = self.engine
        cuts = eng.memory.kind == "plain" and self.ram.on
        best: tuple[int, bool, int, str, Callable[[int], int]] | None = None

        def consider(src_ids: np.ndarray, size: Callable[[], int], source: str,
                     load: Callable[[int], int]) -> None:
            nonlocal best
            n = min(len(src_ids), len(ids), limit)
            differ = np.flatnonzero(src_ids[:n] != ids[:n])
            e = edges.floor(int(differ[0]) if len(differ) else n)
            whole = e == len(src_ids) and source != "slot"
            if e < at_least or not (whole or cuts) or (
                    best is not None and (e, whole) <= best[:2]):
                return
            nbytes = size()
            if source != "slot" or self.ram.fits(nbytes):
                best = (e, whole, nbytes, source, load)

        def cut(src_ids: np.ndarray, state: memoryview, take: int | None) -> Callable[[int], int]:
            def load(e: int) -> int:
                if take is not None and e == len(src_ids):
                    self.ram.take_entry(take)
                eng.restore(src_ids, state)
                return eng.truncate(e)
            return load

        for k, src_ids, state in self.ram.of(job.salt, job.tenant):
            consider(src_ids, partial(len, state), "ram", cut(src_ids, state, k))
        with self.writes_lock:
            waiting = [(q.ids, q.state) for q in self.queued.values()
                       if q.salt == job.salt and q.tenant == job.tenant]
        for src_ids, state in waiting:
            consider(src_ids, partial(len, state), "queued", cut(src_ids, state, None))
        for s, seq in enumerate(eng.seqs):
            if (s != slot and seq.exact_n and self.owners[s] == job.tenant
                    and self.salts[s] == job.salt):
                consider(seq.ids[: seq.exact_n], partial(eng.state_bytes, s), "slot",
                         partial(eng.copy_from, s))
        if best is None:
            return 0
        e, whole, nbytes, source, load = best
        moved = 2 * nbytes if source == "slot" else nbytes
        if not pays(self.costs, keep, e, moved, "ram"):
            return 0
        t = time.perf_counter()
        try:
            kept = load(e)
        except ValueError as ex:  # never expected: the state was this engine's own
            log.warning("a state in memory did not restore (%s); going on without it", ex)
            return 0
        self.costs = self.costs.add_restore("ram", moved, time.perf_counter() - t)
        if not whole:
            self.borrowed[source] += 1
            self.borrowed["tokens"] += kept
        return kept

    def _await_rest(self, queued: float) -> None:
        """Where `write_at_rest`: wait for the llama thread to rest, WRITE_REST_S after the
        state was queued at most, and not while more than WRITE_REST_BYTES wait."""
        if not self.write_at_rest or self.scheduler is None \
                or self.writes["queued_bytes"] > WRITE_REST_BYTES:
            return
        t = time.monotonic()
        rested = self.scheduler.resting.wait(max(queued + WRITE_REST_S - t, 0))
        with self.writes_lock:
            self.writes["at_rest"] += rested
            self.writes["rest_waited_s"] += time.monotonic() - t

    # --- HTTP ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({
            "ready": True, "worker_id": self.worker_id, "n_ctx": self.n_ctx,
            "n_ctx_actual": self.engine.n_ctx, "slots": self.slots,
            "n_live": [s.n_live for s in self.engine.seqs],
            "busy": [i in self.jobs and not self.jobs[i].done() for i in range(self.slots)],
            "cache_ram": self.ram.stats(), "fingerprint": self.fingerprint.hex(),
            "model": self.model_path, "pid": os.getpid(), "boot_id": self.boot_id,
            "flash_attn": self.engine.flash_attn, "llama_cpp_version": llama_cpp.__version__,
            "compute": self.engine.compute,
            "memory": self.engine.memory.to_wire(), "align": self.engine.batching.size,
            "batch_ends": sorted(self.engine.batching.ends),
            "placement": self.engine.placement, "costs": self.costs.to_wire(),
            "shared": self.shared_stats if self.shared is not None else None,
            "exact": self.exact, "writes": {**self.writes, "at_rest_on": self.write_at_rest},
            "borrowed": self.borrowed,
            "cache_volume": volume.read(self.cache_dir),
        })

    async def run(self, request: web.Request) -> web.StreamResponse:
        try:
            job = Job.from_wire(await request.json())
        except ValueError as e:  # a proxy of another version, or a bug: say what is wrong
            return web.json_response({"error": str(e)}, status=400)
        if job.slot >= self.slots:
            return web.json_response({"error": f"slot {job.slot}: this worker has "
                                               f"{self.slots} (--parallel)"}, status=400)
        prev = self.jobs.get(job.slot)
        if prev is not None and not prev.done():
            if not prev.ended:  # one job per slot: two proxies, or a proxy's bug
                return web.json_response({"error": f"slot {job.slot} is running a job"},
                                         status=409)
            # it said `done` (the proxy released the slot on it): its last step is returning
            assert prev.future is not None
            await asyncio.shield(prev.future)
        assert self.scheduler is not None
        this = _SlotJob()
        self.jobs[job.slot] = this
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        cancel = Cancel()
        self.runs[job.run_id] = cancel

        def emit(event: Event) -> None:
            if isinstance(event, Done | CancelledEvent | Error):
                this.ended = True  # before the proxy can see it
            loop.call_soon_threadsafe(queue.put_nowait, event)

        def work() -> Step:
            try:
                yield from self.steps(job, emit, cancel)
            except Exception as e:  # the request fails, the worker lives on
                log.exception("run failed")
                emit(Error(f"{type(e).__name__}: {e}"))

        running = this.future = asyncio.wrap_future(self.scheduler.submit(job.slot, work(),
                                                                              cancel))
        try:
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
        except BaseException:
            cancel.set()
            await running
            self.runs.pop(job.run_id, None)
            raise
        watch = asyncio.create_task(self._watch(request, cancel))
        gone = False  # the proxy closed the stream: nothing more is written
        try:
            # `expected`: saves announced by `done` or `cancelled`
            saves_seen, expected = 0, None
            while expected is None or saves_seen < expected:
                event = await queue.get()
                if isinstance(event, Done | CancelledEvent):
                    expected = event.pending_saves
                elif isinstance(event, Saved | SaveFailed):
                    saves_seen += 1
                elif isinstance(event, Error):
                    expected = saves_seen  # a failed run's pending writes are not awaited
                gone = gone or request.transport is None or request.transport.is_closing()
                if not gone:
                    try:
                        await resp.write(encode_event(event))
                    except (ConnectionError, RuntimeError):
                        gone = True
                        cancel.set()
            await running
        finally:
            watch.cancel()
            cancel.set()  # a job still running stops at its next step, and frees its slot
            self.runs.pop(job.run_id, None)
        with contextlib.suppress(ConnectionError):  # the proxy may close once it has `done`
            await resp.write_eof()
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        """Stop a run at its next prefill batch or token; its stream goes on to report what is
        live and the snapshots still being written."""
        body = await request.json()
        c = self.runs.get(str(body.get("run_id")))
        if c is None:
            return web.json_response({"cancelled": False}, status=404)
        c.set()
        return web.json_response({"cancelled": True})

    async def _watch(self, request: web.Request, cancel: Cancel) -> None:
        while not cancel.is_set:
            if request.transport is None or request.transport.is_closing():
                cancel.set()
                return
            await asyncio.sleep(0.05)


class Boot:
    """The worker from its first second: it listens at once, and until the model is loaded and
    self-checked `/health` answers 503 {"status": "loading", "phase", "progress"} (llama.cpp's
    progress callback, 0..1) and `/run` 503, as llama-server does while it loads. The load runs
    on its own thread; a load that fails stops the process with its one-line reason."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.phase, self.progress = "loading the model", 0.0
        self.worker: Worker | None = None  # set once it serves
        self.error = ""
        self.started = time.monotonic()
        # a test's injected fault (PREFIXGATE_FAULT=slow-load): a disk that reads slowly
        self.slow = os.environ.get("PREFIXGATE_FAULT", "") == "slow-load"

    def _progress(self, p: float) -> None:
        self.progress = p
        if self.slow:
            time.sleep(0.02)

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        spec = self.spec
        try:
            engine = load_engine(spec, self._progress)
            self.phase, self.progress = "self-check", 1.0
            identity = replace(spec.identity, compute=engine.compute)
            worker = Worker(engine, spec.worker_id, spec.cache_dir, identity.fingerprint(),
                            spec.model_path, spec.n_ctx,
                            RamTier.from_mib(spec.cache_ram))
            worker.exact = exactness(engine, spec.worker_id, spec.exact_check,
                                     verdict_key(spec, engine, worker.fingerprint))
            if spec.shared_tier:
                worker.shared = SharedTier(spec.shared_tier, worker.fingerprint)
            worker.start()
        except Exception as e:  # said in one line by `serve`, after the server stopped
            self.error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            loop.call_soon_threadsafe(os.kill, os.getpid(), signal.SIGTERM)
            return
        log.info("worker %d loaded %s in %.1f s: %s%s", spec.worker_id,
                 os.path.basename(spec.model_path), time.monotonic() - self.started,
                 placement_note(engine.placement),
                 f"; flash attention {engine.flash_attn} ({spec.flash_attn} with several slots "
                 "on a CPU: lets decode steps batch)" if engine.flash_attn != spec.flash_attn
                 else "")
        self.worker = worker

    async def begin(self, app: web.Application) -> None:
        threading.Thread(target=self.load, args=(asyncio.get_running_loop(),),
                         name="load", daemon=True).start()

    async def health(self, request: web.Request) -> web.Response:
        if self.worker is not None:
            return await self.worker.health(request)
        return web.json_response({
            "ready": False, "status": "loading", "phase": self.phase,
            "progress": round(self.progress, 3), "worker_id": self.spec.worker_id,
            "pid": os.getpid(), "seconds": round(time.monotonic() - self.started, 1)},
            status=503)

    async def run(self, request: web.Request) -> web.StreamResponse:
        if self.worker is None:
            return web.json_response({"error": "loading the model"}, status=503)
        return await self.worker.run(request)

    async def cancel(self, request: web.Request) -> web.Response:
        if self.worker is None:
            return web.json_response({"cancelled": False}, status=404)
        return await self.worker.cancel(request)


def make_app(boot: Boot, parent_pid: int | None = None) -> web.Application:
    """`parent_pid`: the proxy that spawned this worker; the worker stops when it is gone."""
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", boot.health)
    app.router.add_post("/run", boot.run)
    app.router.add_post("/cancel", boot.cancel)
    app.on_startup.append(boot.begin)
    if parent_pid is not None:
        app.cleanup_ctx.append(lambda app: _exit_with_parent(parent_pid))
    return app


PARENT_CHECK_S = 1.0
# a state file waits at most this long for the llama thread to rest (CPU compute only), and
# does not wait while this much is queued: a snapshot's memory is held until it is written
WRITE_REST_S = 10.0
WRITE_REST_BYTES = 512 << 20
SLOW_DISK_S = 3.0  # PREFIXGATE_FAULT=slow-disk: each state file read takes this much longer


async def _exit_with_parent(parent_pid: int) -> AsyncIterator[None]:
    """A proxy killed without a chance to stop its workers (SIGKILL, the OOM killer) must not
    leave them holding the model and its KV: when the parent is gone, stop as on SIGTERM, so
    runs in flight finish writing the snapshots they took (the next proxy adopts them)."""

    async def watch() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(PARENT_CHECK_S)
        log.warning("the proxy (pid %d) is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    task = asyncio.create_task(watch())
    yield
    task.cancel()


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to run one worker; `prefixgate worker` builds it from the proxy's Config."""

    model_path: str
    n_ctx: int
    threads: int  # 0 = llama.cpp's default
    n_gpu_layers: int
    flash_attn: str  # on | off | auto
    type_k: str  # KV cache types
    type_v: str
    swa_full: bool
    batch: int  # tokens per prefill batch (the reuse granularity)
    exact_check: bool  # run the start-up self-check (backend/selfcheck.py)
    cache_dir: Path
    identity: keys.CacheIdentity
    worker_id: int = 0
    socket: str | None = None  # spawned by the proxy on this Unix socket (and stops with it)
    listen: tuple[str, int] | None = None  # or on TCP, in its own container
    threads_batch: int = 0  # prefill threads; 0 = like threads, else all cores
    # where the weights go (backend/placement.py): split_mode, tensor_split, override_tensor,
    # n_cpu_moe, load_mode, lazy_mode
    placement: dict[str, object] = field(default_factory=dict)
    parallel: int = 1  # slots: sequences in the one context (n_ctx is shared among them)
    cache_ram: int = 0  # MiB of host RAM for states that gave way (-1 no limit, 0 off)
    shared_tier: str = ""  # redis://... of the shared snapshot tier ("" none)


def load_engine(spec: WorkerSpec, progress: Callable[[float], None] | None = None) -> Engine:
    """The worker's engine, as `serve` and `prefixgate doctor` load it."""
    return Engine(spec.model_path, spec.n_ctx, spec.threads or None, spec.n_gpu_layers,
                  n_batch=spec.batch, flash_attn=spec.flash_attn, type_k=spec.type_k,
                  type_v=spec.type_v, swa_full=spec.swa_full,
                  n_threads_batch=spec.threads_batch or None, placement=spec.placement,
                  n_seq=spec.parallel, progress=progress)


def verdict_key(spec: WorkerSpec, engine: Engine, fingerprint: bytes) -> str:
    """The name of the self-check's verdict for this worker (`selfcheck.verdict_key`): its cache
    fingerprint and every other setting the engine got; "" under a test's injected fault."""
    if os.environ.get("PREFIXGATE_FAULT"):
        return ""
    settings = {"n_ctx": engine.n_ctx, "slots": spec.parallel, "threads": spec.threads,
                "threads_batch": spec.threads_batch, "gpu_layers": spec.n_gpu_layers,
                "flash_attn": engine.flash_attn, "batch": engine.n_batch,
                "placement": spec.placement}
    return selfcheck.verdict_key(fingerprint, settings)


def exactness(engine: Engine, worker_id: int, check: bool, key: str = "") -> dict[str, object]:
    """The start-up self-check's verdict, logged in one line: what `/health` reports as
    "exact". Where it fails the worker reuses nothing (module rules). Its decode check sets
    how decode steps of several slots run (`Engine.decode`; apart without the check). `key`:
    the verdict's name (`selfcheck.verdict_key`); a passing verdict remembered under it stands
    for the check, a new one is remembered ("": neither)."""
    if not check:
        if engine.inexact:
            log.warning("worker %d: cache reuse off: %s", worker_id, engine.inexact)
            return {"ok": False, "checked": False, "failure": engine.inexact}
        log.info("worker %d: exactness not checked (--no-exact-check)", worker_id)
        return {"ok": True, "checked": False, "failure": ""}
    verdict: dict[str, Any] | None = selfcheck.recall(key) if key and not engine.inexact \
        else None
    remembered = verdict is not None
    if verdict is None:
        report = selfcheck.run(engine)
        verdict = dict(report.to_wire())
        if key and report.ok:
            selfcheck.remember(key, verdict)
    decode = verdict.get("batch_decode") or {}
    engine.decode = decode.get("mode", "apart")
    if decode:
        log.info("worker %d: decode steps of several slots %s", worker_id, {
            "batched": "share a llama_decode (each slot's logits proven equal to its own alone)",
            "fixed": "share a llama_decode of a fixed shape, a row per slot, padding rows in "
                     "the idle ones (each slot's logits proven the same whatever the others "
                     f"hold; as they come they would differ: {decode.get('detail')})",
            "apart": f"run apart ({decode.get('detail')})"}[engine.decode])
    if verdict["ok"]:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(verdict["checked_at"])) \
            if remembered else ""
        log.info("worker %d: exact reuse proven in %.1f s (%s on %d probe tokens, batch %d)%s",
                 worker_id, verdict["seconds"], ", ".join(c["check"] for c in verdict["checks"]),
                 verdict["probe_tokens"], engine.batching.size,
                 f"; remembered from {when}: the same model, settings, build and code "
                 "(`prefixgate doctor` checks again)" if remembered else "")
    else:
        log.warning("worker %d: exactness self-check FAILED (%s): serving without cache "
                    "reuse; `prefixgate doctor` prints the checks", worker_id, verdict["failure"])
    return {"checked": True, **verdict, "remembered": remembered}


def serve(spec: WorkerSpec) -> None:
    """Listen at once (`Boot`), load, serve; a load that failed is a ValueError (one line)."""
    boot = Boot(spec)
    if spec.listen is not None:
        host, port = spec.listen
        log.info("worker %d listening on %s:%d (model %s, cache %s); loading", spec.worker_id,
                 host, port, spec.model_path, spec.cache_dir)
        web.run_app(make_app(boot), host=host, port=port, print=None, handle_signals=True,
                    access_log=None)
    else:
        assert spec.socket is not None
        if os.path.exists(spec.socket):
            os.unlink(spec.socket)
        # spawned by the proxy: stop with it
        web.run_app(make_app(boot, parent_pid=os.getppid()), path=spec.socket, print=None,
                    handle_signals=True, access_log=None)
    if boot.error:
        raise ValueError(boot.error)
    if boot.worker is None:  # stopped while loading: the load thread is not waited for
        logging.shutdown()
        os._exit(0)
