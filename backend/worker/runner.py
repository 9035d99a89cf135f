"""The runner: the core's compute effects and the scheduler's steps, done on the engine. It runs
on the compute thread only, decides nothing, and reports each result as the core's input.

    Runner(engine, tiers, write).effect(effect, core) -> input | None
    Runner.step(step, core) -> [input, ...]

- `Prefill(slot, n)`: the slot's next batch of the cold run's (`Engine.prefill_batch`).
- `Decode(slots)`: one llama_decode of each slot's waiting token, in the shape the engine's
  `decode_shape` says; each slot is charged the step's time.
- `Verify(slots)`: each slot's waiting token and its draft, every row's logits, the rows sampled
  and the rejected drafts cut back (backend.worker.verify). Decode and verify steps' seconds
  over their rows are measured as the worker runs (`step_rows`, reported with speculation).
- Loads restore a state into a slot and cut it back to what the prompt keeps; a failure is a
  `Fault` in the result (the state was this engine's own or verified, so it is never expected).
- A snapshot's key is computed here (xxh3 over the ids: microseconds), its copy queued in the
  tiers and its file written on the writer thread (`write`). A job's last snapshot takes the
  draft model's state of its tokens along, where one pays (`DraftModel.twin`): where files are
  written at once (a GPU), what the draft model holds of them then (most often the session's
  previous prompt); once the draft model holds the job's prompt, a longer one while the
  snapshot still waits for its file (on a CPU it waits for the compute thread to rest; a
  window's is taken as the draft model's prefill passes the snapshot's tokens, since a
  window's snapshot holds the state at the sequence's end only: `DraftModel.want`). A
  restore of a file or a queued snapshot that has one loads it into the slot's draft sequence.
- Samplers are the slots' own (llama.cpp's chains), from `StartSampling` to `Finish`.
- `Park` keeps a generating run's state, sequence fields and sampler aside for a nested job
  (`backend.worker.core`); `Unpark` loads them back into its slot after that job's `Finish`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backend import keys
from backend.engine import Engine
from backend.protocol import Fault
from backend.sampling import Sampler, Sampling
from backend.worker.core import Core
from backend.worker.live import live_event
from backend.worker.messages import (
    Cut,
    Effect,
    Failed,
    Filling,
    Finish,
    GiveWay,
    Held,
    Ids,
    Input,
    Load,
    Loaded,
    Park,
    Sample,
    Sampled,
    Snapshot,
    Snapshotted,
    StartSampling,
    Stepped,
    Unpark,
    Verified,
)
from backend.worker.tiers import Payload, Tiers
from backend.worker.verify import verify
from policies.costs import Fit
from policies.schedule import Decode, Prefill, Step, Verify

log = logging.getLogger("prefixgate.worker")

Write = Callable[[str, keys.CacheKey, Snapshot, tuple[int, ...], memoryview, str], None]


@dataclass(slots=True)
class Runner:
    engine: Engine
    tiers: Tiers
    write: Write  # queue a snapshot's file for the writer thread
    samplers: dict[int, Sampler] = field(default_factory=dict)
    held: list[Held] = field(default_factory=list)  # the core's view of the tiers, at Arrive
    step_rows: Fit = field(default_factory=Fit)  # seconds = fixed + per_row * rows of a step
    # slot -> (its job's last snapshot's key, its tokens, the owner, the run): a twin to make
    # or make longer once the draft model holds the job's prompt (`_retwin`)
    twins: dict[int, tuple[keys.CacheKey, Ids, tuple[str, bytes], str]] = field(
        default_factory=dict)
    # slot -> its parked run's state, ids, exact_n, padded, rollback and sampler (`Park`)
    parked: dict[int, tuple[memoryview, Ids, int, int, int, Sampler]] = field(
        default_factory=dict)

    def effect(self, e: Effect, core: Core) -> Input | None:
        eng = self.engine
        if isinstance(e, Cut):
            eng.truncate(e.slot, e.n)
            if self.tiers.every:
                self.tiers.said_live(live_event(eng, e.slot, core.owners[e.slot]))
        elif isinstance(e, GiveWay):
            if eng.truncate(e.slot, e.n) == e.n:
                q = eng.seqs[e.slot]
                ids = q.ids[: e.n].copy()
                model = core.spec.model if core.spec is not None else None
                size = eng.state_bytes(e.slot) + (
                    model.engine.state_bytes(e.slot) if model is not None else 0)
                with self.tiers.moving(size):  # until made (then held)
                    state = eng.snapshot(e.slot)
                    draft = None if model is None else \
                        model.give_way(e.slot, (e.tenant, e.salt), ids)
                self.tiers.give_way(e.salt, e.tenant, ids, state, draft)
        elif isinstance(e, Load):
            return self._load(e, core)
        elif isinstance(e, Snapshot):
            return self._snapshot(e, core)
        elif isinstance(e, StartSampling):
            try:
                self.samplers[e.slot] = eng.sampler(Sampling.from_json(e.sampling), e.grammar,
                                                    e.slot)
            except ValueError as ex:
                return Failed(e.slot, str(ex))
        elif isinstance(e, Sample):
            token = eng.sample(e.slot, self.samplers[e.slot])
            eog = token in eng.eog
            return Sampled(e.slot, token, b"" if eog else eng.piece(token), eog)
        elif isinstance(e, Finish):
            sampler = self.samplers.pop(e.slot, None)
            if sampler is not None:
                sampler.close()
            if self.tiers.every:
                self.tiers.said_live(live_event(eng, e.slot, core.owners[e.slot]))
        elif isinstance(e, Park | Unpark):
            return self._park(e, core)
        return None

    def _park(self, e: Park | Unpark, core: Core) -> Input | None:
        """A generating run kept aside for a nested job, and put back: its state byte for byte
        (counted as the worker's memory while kept), its sequence's fields, its sampler."""
        eng, q = self.engine, self.engine.seqs[e.slot]
        if isinstance(e, Park):
            state = eng.snapshot(e.slot)
            self.tiers.keeps(state)
            self.parked[e.slot] = (state, q.ids[: q.n_live].copy(), q.exact_n, q.padded,
                                   q.rollback, self.samplers.pop(e.slot))
            eng.truncate(e.slot, 0)
        else:
            state, ids, exact_n, padded, rollback, sampler = self.parked.pop(e.slot)
            if e.drop:
                sampler.close()
                return None
            self.samplers[e.slot] = sampler  # freed by the run's `Finish`, whatever comes
            try:
                eng.restore(e.slot, ids, state)
            except ValueError as ex:  # never expected: its own state, in its own context
                return Failed(e.slot, f"its state did not load back: {ex}")
            q.exact_n, q.padded, q.rollback = exact_n, max(q.padded, padded), rollback
        if self.tiers.every:
            self.tiers.said_live(live_event(eng, e.slot, core.owners[e.slot]))
        return None

    def _load(self, e: Load, core: Core) -> Loaded:
        eng, c, t = self.engine, e.candidate, time.perf_counter()
        try:
            if c.tier == "slot":
                with self.tiers.moving(eng.state_bytes(e.src)):  # the copy, until loaded
                    kept = eng.copy(e.src, e.slot, e.n)
            elif isinstance(e.payload, Payload):
                p = e.payload
                eng.restore(e.slot, p.ids, p.state, prepared=p.padded)
                kept = eng.truncate(e.slot, e.n)
                if p.draft is not None:
                    job = core.jobs[e.slot].job
                    self._load_draft(e.slot, (job.tenant, job.salt), p.draft, core)
            else:
                h = next((h for h in self.held if h.tier == c.tier and h.ref == c.ref), None)
                got = None if h is None else self.tiers.state(h)
                if h is None or got is None:
                    return Loaded(e.slot, e.run_id, c, 0, 0.0,
                                  Fault("missing", f"the {c.tier} state left its tier", ""))
                if c.tier == "ram":  # read by this thread only: its form made in place
                    eng.restore_held(e.slot, got[0], got[1])
                else:  # a queued write, which the writer thread reads: copied for the load
                    with self.tiers.moving(len(got[1])):
                        eng.restore(e.slot, got[0], got[1])
                self._load_draft(e.slot, (h.tenant, h.salt), self.tiers.draft(h), core,
                                 shared=c.tier == "queued")
                kept = eng.truncate(e.slot, e.n)
                if c.whole and kept == e.n:
                    self.tiers.taken(h)
        except ValueError as ex:  # never expected: the state was this engine's, or verified
            return Loaded(e.slot, e.run_id, c, 0, time.perf_counter() - t,
                          Fault("corrupt", f"the {c.tier} state did not load: {ex}", ""))
        return Loaded(e.slot, e.run_id, c, kept, time.perf_counter() - t)

    def _load_draft(self, slot: int, owner: tuple[str, bytes],
                    got: tuple[Ids | tuple[int, ...], memoryview] | None,
                    core: Core, shared: bool = False) -> None:
        """The draft model's state kept with a RAM entry, a queued snapshot or a file (ids,
        bytes), into the slot's draft sequence (its first draft keeps what the prompt shares of
        it); one that does not load is a miss there: that job's draft model prefills its
        prompt. `shared`: a queued snapshot's, which the writer thread reads too (copied)."""
        model = core.spec.model if core.spec is not None else None
        if model is None or got is None or slot in core.parked:  # a nested job drafts nothing:
            return  # the slot's draft sequence stays its parked run's
        try:
            model.restore(slot, owner, got[0], got[1], shared)
        except ValueError as ex:  # never expected: the state was this worker's own or verified
            log.warning("worker: a draft model state did not load (%s): its prompt is "
                        "prefilled", ex)

    def _snapshot(self, e: Snapshot, core: Core) -> Snapshotted:
        eng, q, job = self.engine, self.engine.seqs[e.slot], core.jobs[e.slot].job
        if e.behind:
            if not eng.can_snapshot_behind(e.slot, e.n):
                return Snapshotted(e.run_id, False)
            try:
                with self.tiers.moving(eng.state_bytes(e.slot)):  # the whole, then the part
                    state = eng.snapshot_behind(e.slot, e.n)
            except ValueError:
                return Snapshotted(e.run_id, False)
        else:
            assert q.n_live == e.n, (q.n_live, e.n)
            with self.tiers.moving(eng.state_bytes(e.slot)):  # until made (then queued)
                state = eng.snapshot(e.slot)
        ids = job.ids[: e.n]
        key = keys.prefix_keys(job.salt, ids, [e.n])[e.n]
        if self.tiers.on_disk(key):
            return Snapshotted(e.run_id, False)
        tokens = q.ids[: e.n].copy()
        model = core.spec.model if core.spec is not None else None
        twin = None
        last = model is not None and bool(self.tiers.draft_fingerprint) \
            and e.n == max(core.jobs[e.slot].saves) \
            and e.slot not in core.parked  # the job's last (its prompt's), not a nested job's
        if last and model is not None:
            self.twins[e.slot] = (key, tokens, (job.tenant, job.salt), e.run_id)
            if self.tiers.at_rest is None:  # its file is written at once: what it holds now
                with self.tiers.moving(model.engine.state_bytes(e.slot)):  # until queued
                    twin = model.twin((job.tenant, job.salt), tokens, core.costs.disk)
        if not self.tiers.queue(key, job.salt, job.tenant, tokens, state, twin):
            self.twins.pop(e.slot, None)
            return Snapshotted(e.run_id, False)
        if last and self.tiers.at_rest is not None and model is not None:
            model.want(e.slot, e.run_id, e.n, core.costs.disk)  # a window's: as it prefills
        self.write(e.run_id, key, e, ids, state, job.tenant)
        return Snapshotted(e.run_id, True)

    def step(self, step: Step, core: Core) -> list[Input]:
        """Evaluate the step; each slot's result (its share of the time, or its failure)."""
        eng, t = self.engine, time.perf_counter()
        if isinstance(step, Verify):
            results = verify(eng, self.samplers, step, core)
            if self.twins:
                self._retwin(core)
            if not any(isinstance(r, Filling) for r in results):  # a verify alone, measured
                self._measured(sum(1 + len(r.draft) if isinstance(r, Verified) else 1
                                   for r in results if isinstance(r, Stepped | Verified)),
                               max((r.seconds for r in results
                                    if isinstance(r, Stepped | Verified)), default=0.0))
            return results
        if isinstance(step, Prefill):
            slots = [step.slot]
            ids = core.jobs[step.slot].job.ids
            end = eng.seqs[step.slot].n_live + step.n
            run: Callable[[], None] = lambda: eng.prefill_batch(step.slot, ids, end)  # noqa: E731
        else:
            assert isinstance(step, Decode)
            slots = list(step.slots)
            tokens = {s: core.waiting(s) for s in slots}
            run = lambda: eng.decode(tokens)  # noqa: E731
        try:
            run()
        except (RuntimeError, ValueError) as ex:
            return [Failed(s, f"{type(ex).__name__}: {ex}") for s in slots]
        dt = time.perf_counter() - t
        if isinstance(step, Decode):
            self._measured(len(slots), dt)
        return [Stepped(s, dt) for s in slots]

    def _retwin(self, core: Core) -> None:
        """Where a slot's draft model now holds its job's prompt: the twin of the job's last
        snapshot, made or made longer, while that snapshot still waits for its file."""
        model = core.spec.model if core.spec is not None else None
        for slot, (key, ids, owner, run) in list(self.twins.items()):
            j = core.jobs.get(slot)
            if model is None or j is None or j.job.run_id != run:
                del self.twins[slot]  # the job ended before its draft model held its prompt
                if model is not None:
                    model.drop_kept(slot, run)
                continue
            if not model.holds_prompt(slot, run):
                continue
            del self.twins[slot]
            had = self.tiers.twin_n(key)
            if had is not None:  # not written yet (nor being written)
                with self.tiers.moving(model.engine.state_bytes(slot)):  # about, until queued
                    twin = model.twin(owner, ids, core.costs.disk, above=had)
                    if twin is not None:
                        self.tiers.retwin(key, twin)
            model.drop_kept(slot, run)

    def _measured(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self.step_rows = self.step_rows.add(1.0, float(rows), seconds)
