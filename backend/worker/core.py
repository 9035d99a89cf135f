"""The worker's slot machines, without I/O: `Core.apply(input, world) -> effects`.

The core is what the worker *decides*: for each slot's job, which state its prompt starts from,
where it snapshots, which batch it prefills next, when its answer ends. It computes nothing and
touches nothing: the compute loop (`backend.worker.loop`) feeds it inputs (a job arrived, a read
came back, a batch was evaluated, a token sampled) with a `World` (what each slot's live KV and
the worker's memory hold right now), performs the effects it returns in order, on the thread each
belongs to, and feeds their results back. It imports no runner, thread, clock or llama_cpp (the
layout test holds it to that), so its rules are tested with tables of inputs and exact effects.

A job's life (the events are `backend.protocol`'s, in its order):

1. **Arrive.** Nothing is reused unless the start-up self-check passed (`exact`). The prompt's
   batch edges are its cold run's (`policies.prefix.Batching`); it reuses at most `limit`, the
   plan's `keep_max` held to the last edge before its last token. `keep`: what the slot's live
   KV holds of it, where the plan allows (`live_ok`) and the KV is this tenant's. Before the
   live KV is replaced, the part of it a next request could reuse gives way to the RAM tier
   (`GiveWay`: cut back to a batch edge first), unless this prompt extends all of it.
2. **Start.** The states it may start from: other slots' live KV, snapshots waiting for their
   files, the RAM tier's entries (all of its salt and tenant, compared here up to the last batch
   edge they share with the prompt), and the plan's disk and shared entries;
   `policies.sources.choose_start` orders them (the rule `decide()` follows too). Memory loads
   on the compute thread (`Load`); a disk or shared entry is read and verified on the reader
   thread first (`Read`), so the other slots go on generating meanwhile, then loaded. A failure
   is a `Fault` in `Start` and the next candidate is tried; then whatever was loaded is cut back
   to what the prompt may keep (`Cut`), and `Start` is emitted (and the `Saved` of an entry
   pulled from the shared tier: a local entry now). Snapshots behind the reuse are copied from
   the live KV (`Snapshot`, `behind`). Where another slot is prefilling the prompt's first
   tokens (rule 5 of `policies.sources`), the job first follows it: no compute of its own
   until that slot holds them (or ends, or generates), then its start is chosen again.
3. **Prefill.** A task for the scheduler (`tasks()`, `policies.schedule`) until the prompt is
   evaluated: each `Prefill` step one batch of the cold run's; after each, `Prefill` is emitted
   and a save point reached is snapshotted. The step that evaluates the last batch samples at
   once (`Sample`): the logits are gone at the next llama_decode.
4. **Generate.** Each sampled token is fed to the stop matcher and emitted; the answer ends on
   an end-of-generation token, a stop string, `max_tokens` or a full context; otherwise the
   token waits for its decode (a task again: `Decode` steps of several slots as the scheduler
   shapes them), after which the slot samples at once. With speculation
   (backend.worker.drafts) the waiting token may bring a draft: its step is a `Verify`, whose
   samples (`Verified`) are taken in order as single ones are, up to the answer's end.
5. **End.** `Done` (or `Cancelled` after a cancel, `Error` after a failure) with what the live
   KV holds that a next request may keep and the saves still coming; the slot takes a new job
   from then on. Saves are written on the writer thread and reported by it.

A short job may come *nested* on a slot whose run generates (`Job.nest`, policies.preempt rule
4): that run is parked between two of its steps (`Park`: its state byte for byte in host RAM)
and the nested job lives as any other, without speculation; at its `Finish` the run is put back
as it was (`Unpark`) and goes on; one whose client leaves meanwhile is dropped there. Where the
run is not between its steps, or there is no RAM tier or the state is larger than its budget,
the job waits for the run's end instead and then arrives as any job (`Again`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.protocol import (
    Cancelled,
    Done,
    Error,
    Job,
    Kept,
    Prefill,
    Start,
    Token,
)
from backend.stops import StopMatcher
from backend.worker.drafts import SlotDrafts, Speculation
from backend.worker.job_state import JobState
from backend.worker.messages import (
    Again,
    Arrive,
    CancelRun,
    Cut,
    Effect,
    Emit,
    Filling,
    Finish,
    Input,
    Live,
    Load,
    Loaded,
    Park,
    Read,
    ReadDone,
    Sample,
    Sampled,
    Snapshot,
    Snapshotted,
    StartSampling,
    Stepped,
    Unpark,
    Verified,
    World,
    give_way,
    in_memory,
    live_prefix,
    reusable,
    shared_edge,
)
from policies.costs import Costs
from policies.prefix import Batching
from policies.schedule import Task
from policies.sources import COST_SOURCE, Candidate, choose_start, follows

# --- the machine --------------------------------------------------------------------------------


@dataclass(slots=True)
class Core:
    """Every slot's job, and what the worker has learnt (costs, borrow counts)."""

    n_slots: int
    batching: Batching
    cuts: bool  # plain attention: the live KV can be cut back to any position
    ram_budget: int  # bytes of the RAM tier (< 0 no limit, 0 off)
    exact: bool = True  # the start-up self-check passed
    n_ctx: int = 0  # one slot's context (0: no bound here)
    costs: Costs = field(default_factory=Costs)
    jobs: dict[int, JobState] = field(default_factory=dict)
    owners: list[tuple[str, bytes]] = field(default_factory=list)  # (tenant, salt) of each KV
    borrowed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("slot", "ram", "queued", "tokens"), 0))
    spec: Speculation | None = None  # speculative decoding (backend.worker.drafts)
    # slot -> its generating run and the live KV's owner, while a nested job runs (`Park`)
    parked: dict[int, tuple[JobState, tuple[str, bytes]]] = field(default_factory=dict)
    deferred: dict[int, Job] = field(default_factory=dict)  # nested jobs that wait instead
    drafted: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafted,
    # accepted, verifies] of the jobs that ended

    def __post_init__(self) -> None:
        self.owners = self.owners or [("", b"")] * self.n_slots

    # --- the scheduler's view ----------------------------------------------------------------

    def tasks(self, world: World) -> list[Task]:
        """The slots with compute to do (`policies.schedule.Task`)."""
        out = []
        for slot, j in self.jobs.items():
            if j.phase == "prefill":
                n_live = world.slots[slot].n_live
                out.append(Task(slot, len(j.ids) - n_live, j.edges.next(n_live) - n_live))
            elif j.phase == "waits":
                out.append(Task(slot, waits=True,
                                draft=len(j.drafts.draft) if j.drafts is not None else 0,
                                fills=j.fills))
        return out

    @property
    def following(self) -> bool:
        """A job waits for another slot's prefill (it starts from the memory when it wakes)."""
        return any(j.phase == "follows" for j in self.jobs.values())

    def wakes_on(self, inp: Input) -> bool:
        """Whether the input may wake a job that follows (`_wake`): only its leader's; the
        others need not read every slot's state size (a dry run of llama.cpp's writer each)."""
        leaders = {j.leader[:2] for j in self.jobs.values() if j.phase == "follows"}
        if isinstance(inp, CancelRun):
            return any(run == inp.run_id for _, run in leaders)
        slot = inp.job.slot if isinstance(inp, Arrive) else getattr(inp, "slot", None)
        return any(s == slot for s, _ in leaders)

    def waiting(self, slot: int) -> int:
        """The token the slot's decode evaluates."""
        return self.jobs[slot].token

    def draft(self, slot: int) -> list[int]:
        """The draft a verify evaluates after the waiting token."""
        d = self.jobs[slot].drafts
        return d.draft if d is not None else []

    # --- inputs -----------------------------------------------------------------------------

    def apply(self, inp: Input, world: World) -> list[Effect]:
        effects = self._apply(inp, world)
        if self.following:
            effects += self._wake(world)
        return effects

    def _apply(self, inp: Input, world: World) -> list[Effect]:
        if isinstance(inp, Arrive):
            return self._arrive(inp.job, world)
        if isinstance(inp, CancelRun):
            return self._cancel(inp, world)
        if isinstance(inp, Snapshotted):
            for k in self.jobs.values():
                if k.job.run_id == inp.run_id:
                    k.pending += inp.queued
            return []
        j = self.jobs.get(inp.slot)
        if j is None:
            return []  # a result for a job that has ended (cancelled meanwhile)
        if isinstance(inp, Loaded | ReadDone) and inp.run_id != j.job.run_id:
            return []
        if isinstance(inp, ReadDone):
            return self._read(inp.slot, j, inp, world)
        if isinstance(inp, Loaded):
            return self._loaded(inp.slot, j, inp, world)
        if isinstance(inp, Stepped):
            j.fills = False
            return self._stepped(inp.slot, j, inp.seconds, world)
        if isinstance(inp, Sampled):
            return self._sampled(inp.slot, j, inp, world) + self._propose(inp.slot, j, world)
        if isinstance(inp, Verified):
            j.fills = False
            return self._verified(inp.slot, j, inp, world)
        if isinstance(inp, Filling):  # its token and draft wait, its next verify alone
            j.fills = True
            return []
        return [Emit(j.job.run_id, Error(inp.message)), *self._finish(inp.slot)]

    def _cancel(self, inp: CancelRun, world: World) -> list[Effect]:
        """A client's cancel, or a preemption's (`prefilling`: only before the first sample)."""
        run = inp.run_id
        out = next((s for s, (j, _) in self.parked.items() if j.job.run_id == run), None)
        if out is not None:  # its client left while it was parked (it has sampled)
            if inp.prefilling:
                return []
            gone = self._ended(self.parked.pop(out)[0])
            return [Emit(run, Cancelled(0, 0, gone.pending)), Unpark(out, drop=True)]
        later = next((s for s, job in self.deferred.items() if job.run_id == run), None)
        if later is not None:  # it left while it waited for its slot's run to end
            del self.deferred[later]
            return [Emit(run, Cancelled(0, 0, 0))]
        slot = next((s for s, j in self.jobs.items() if j.job.run_id == run), None)
        if slot is None:
            return []  # ended
        phase = self.jobs[slot].phase
        if inp.prefilling and phase not in ("start", "follows", "prefill"):
            return []  # a preemption that came after its first sample
        if inp.prefilling and phase == "prefill" and (
                self.ram_budget == 0 or 0 < self.ram_budget < world.slots[slot].nbytes):
            return [Emit(run, Kept("its state would not fit the RAM tier"))]
        return self._end(slot, world)

    def _arrive(self, job: Job, world: World) -> list[Effect]:
        parked: list[Effect] = []
        if job.nest and job.slot in self.jobs:  # a short job nested on its generating run
            assert job.slot not in self.parked, f"slot {job.slot} has a nested job"
            if self.jobs[job.slot].phase != "waits" or self.ram_budget == 0 \
                    or 0 < self.ram_budget < world.slots[job.slot].nbytes:
                self.deferred[job.slot] = job  # it waits for that run's end (`Again`)
                return []
            parked, world = self._park(job.slot, world)
        assert job.slot not in self.jobs, f"slot {job.slot} is running a job"
        slot, plan = job.slot, job.plan
        ids = np.asarray(job.ids, dtype=np.intc)
        edges = self.batching.edges(job.ids)
        limit = min(plan.keep_max, edges.keep_max) if self.exact else 0
        live = world.slots[slot]
        mine = plan.live_ok and self.exact and self.owners[slot] == (job.tenant, job.salt)
        keep = live_prefix(live, ids, edges, limit) if mine else 0
        j = JobState(job, ids, edges, limit, mine, keep, world.now_s)
        j.came_s = world.now_s - job.waited_s
        j.saves = {s.n_tokens: s for s in plan.saves if self.exact and s.n_tokens in edges}
        self.jobs[slot] = j
        effects = parked
        if self.exact and self.ram_budget != 0:
            effects += give_way(self.batching, self.owners[slot], slot, job, ids, keep, live)
        if self.exact:
            j.order = self._order(slot, j, world)
            leader = self._leader(slot, j, world)
            if leader is not None:
                j.phase, j.leader = "follows", leader
                return effects
        return effects + self._attempt(slot, j, world)

    def _park(self, slot: int, world: World) -> tuple[list[Effect], World]:
        """The slot's run, between its steps, kept aside (`Park`) until the nested job's
        `Finish`; the nested job sees the slot empty."""
        self.parked[slot] = (self.jobs.pop(slot), self.owners[slot])
        slots = list(world.slots)
        slots[slot] = Live(slots[slot].ids[:0], 0, 0, 0)
        return [Park(slot)], World(slots, world.held, world.now_s)

    def _order(self, slot: int, j: JobState, world: World) -> list[Candidate]:
        """The states its prompt may start from, best first (`policies.sources.choose_start`)."""
        cands = in_memory(slot, j.job, j.ids, j.edges, j.limit, world, self.owners, self.cuts,
                          self.ram_budget) + [
            Candidate(r.tier, r.n_tokens, True, r.size_bytes, -1 - i)
            for i, r in enumerate(j.job.plan.restore) if r.n_tokens in j.edges]
        return list(choose_start(j.keep, cands, j.limit, self.cuts, self.costs).order)

    def _leader(self, slot: int, j: JobState, world: World) -> tuple[int, str, int] | None:
        """Another slot prefilling this prompt's first tokens, worth waiting for (rule 5 of
        `policies.sources`): (its slot, its run, the batch edge it is to reach), or None. A
        copy passes through host RAM: only with a RAM tier. Plain attention copies the part
        from the slot's KV at any time; a window or a recurrent state is copied whole at the
        moment that slot's KV ends at the edge (a batch of its prefill ends there: the edges
        of two prompts are the same up to where they part, `policies.prefix.Batching`)."""
        if self.ram_budget == 0:
            return None
        now = max([j.keep, *(min(c.n_tokens, j.limit) for c in j.order[:1])])
        best: tuple[int, str, int] | None = None
        for s, k in self.jobs.items():
            if s == slot or k.phase != "prefill" or self.owners[s] != (j.job.tenant,
                                                                        j.job.salt):
                continue
            shared = shared_edge(k.ids, j.ids, j.edges, min(len(k.ids), len(j.ids), j.limit))
            if shared > world.slots[s].n_live and follows(now, shared, self.batching.size) \
                    and (best is None or shared > best[2]):
                best = (s, k.job.run_id, shared)
        return best

    def _wake(self, world: World) -> list[Effect]:
        """The jobs that follow another slot's prefill, once it holds what they wait for, or
        ended, or went on to generate (then with what it left): their start chosen again. The
        input that brings it there is the batch that ends at the edge: its KV ends there
        still, as a whole copy of a window or a recurrent state needs."""
        effects: list[Effect] = []
        for slot, j in list(self.jobs.items()):
            if j.phase != "follows":
                continue
            s, run, until = j.leader
            k = self.jobs.get(s)
            if k is not None and k.job.run_id == run and k.phase == "prefill" \
                    and world.slots[s].n_live < until:
                continue
            j.phase, j.leader = "start", (-1, "", 0)
            j.order = self._order(slot, j, world)
            effects += self._attempt(slot, j, world)
        return effects

    def _attempt(self, slot: int, j: JobState, world: World) -> list[Effect]:
        """Load the next candidate, or, with none left, begin from what the slot holds."""
        if not j.order:
            return self._begin(slot, j, world)
        c = j.order.pop(0)
        if c.tier in ("disk", "shared"):
            return [Read(slot, j.job.run_id, j.job, -1 - c.ref)]
        n = min(c.n_tokens, j.limit)
        return [Load(slot, j.job.run_id, c, n, src=c.ref if c.tier == "slot" else -1)]

    def _read(self, slot: int, j: JobState, r: ReadDone, world: World) -> list[Effect]:
        if r.pulled is not None:  # a local entry now, whether it loads or not
            j.pulled.append(r.pulled)
        if r.fault is not None:
            j.faults.append(r.fault)
            return self._attempt(slot, j, world)
        entry = j.job.plan.restore[r.index]
        j.read_s = r.seconds
        c = Candidate(entry.tier, entry.n_tokens, True, entry.size_bytes, -1 - r.index)
        return [Load(slot, j.job.run_id, c, min(entry.n_tokens, j.limit), payload=r.payload)]

    def _loaded(self, slot: int, j: JobState, r: Loaded, world: World) -> list[Effect]:
        c = r.candidate
        if r.fault is not None or r.kept == 0:
            if r.fault is not None:
                j.faults.append(r.fault)
            # a failed load may have emptied the slot: what it holds now
            j.keep = self._keep(slot, j, world) if j.mine else 0
            return self._attempt(slot, j, world)
        seconds = r.seconds + (j.read_s if c.tier in ("disk", "shared") else 0.0)
        self.costs = self.costs.add_restore(COST_SOURCE[c.tier], c.moved_bytes, seconds)
        j.keep, j.source = r.kept, c.tier
        if c.tier in ("disk", "shared"):
            j.restored = c.n_tokens
        else:
            j.from_memory = r.kept
            if not c.whole:
                self.borrowed[c.tier] += 1
                self.borrowed["tokens"] += r.kept
        return self._begin(slot, j, world)

    def _keep(self, slot: int, j: JobState, world: World) -> int:
        return live_prefix(world.slots[slot], j.ids, j.edges, j.limit)

    def _begin(self, slot: int, j: JobState, world: World) -> list[Effect]:
        """The prompt starts from `j.keep` tokens: `Start`, the pulled entries' `Saved`, the
        snapshots behind the reuse; then its prefill is a task."""
        job, run = j.job, j.job.run_id
        self.owners[slot] = (job.tenant, job.salt)
        j.phase, j.prefill_from = "prefill", j.keep
        effects: list[Effect] = [
            Cut(slot, j.keep),
            Emit(run, Start(j.keep, j.restored, world.now_s - j.started_s, tuple(j.faults),
                            j.from_memory, j.source if j.keep else "live")),
            *(Emit(run, e) for e in j.pulled)]
        j.pending += len(j.pulled)
        effects += [Snapshot(slot, run, p, j.saves[p], behind=p < j.keep)
                    for p in sorted(j.saves) if 0 < p <= j.keep]
        if j.keep >= len(j.ids):  # never: at least the last token is evaluated
            return effects + [Emit(run, Error("nothing to prefill")), *self._finish(slot)]
        return effects

    def _stepped(self, slot: int, j: JobState, seconds: float, world: World) -> list[Effect]:
        n_live, run = world.slots[slot].n_live, j.job.run_id
        if j.phase == "prefill":
            j.busy_s += seconds
            effects: list[Effect] = [Emit(run, Prefill(n_live))]
            if n_live in j.saves:
                effects.append(Snapshot(slot, run, n_live, j.saves[n_live]))
            if n_live < len(j.ids):
                return effects
            self.costs = self.costs.add_prefill(j.prefill_from, len(j.ids), j.busy_s)
            j.phase, j.generating_s = "generate", world.now_s
            j.matcher = StopMatcher(j.job.stop)
            if self.spec is not None and self.spec.on and slot not in self.parked:
                j.drafts = SlotDrafts.start(self.spec, j.ids)  # a nested job's: none
            if j.job.max_tokens <= 0:
                return effects + self._done(slot, j, world, "length", None)
            return effects + [StartSampling(slot, dict(j.job.sampling), j.job.grammar),
                              Sample(slot)]
        j.phase = "generate"  # its decode: it samples at once
        self.costs = self.costs.add_decode(seconds)
        return [Sample(slot)]

    def _sampled(self, slot: int, j: JobState, s: Sampled, world: World,
                 n_live: int | None = None) -> list[Effect]:
        """`n_live`: the slot's evaluated tokens when it was sampled (a verify's earlier
        samples: fewer than the world's)."""
        run = j.job.run_id
        n_live = world.slots[slot].n_live if n_live is None else n_live
        if s.eog:
            return self._done(slot, j, world, "stop", None)
        j.n_gen += 1
        text, matched = j.matcher.feed(s.piece)
        effects: list[Effect] = [Emit(run, Token(s.token, text))]
        if matched is not None:
            return effects + self._done(slot, j, world, "stop_sequence", matched)
        if j.n_gen >= j.job.max_tokens or (self.n_ctx and n_live >= self.n_ctx):
            return effects + self._done(slot, j, world, "length", None)
        j.phase, j.token = "waits", s.token
        return effects

    def _propose(self, slot: int, j: JobState, world: World) -> list[Effect]:
        """A token that waits for its step gets the draft to verify beside it, if any."""
        if j.drafts is not None and self.jobs.get(slot) is j and j.phase == "waits":
            live = world.slots[slot]
            j.drafts.propose(live.ids[: live.n_live], j.token, j.n_gen,
                             j.job.max_tokens - j.n_gen, self.n_ctx)
        return []

    def _verified(self, slot: int, j: JobState, v: Verified, world: World) -> list[Effect]:
        """A verify's samples, in order, as single ones, until the answer ends."""
        assert j.drafts is not None and v.samples
        j.drafts.verified(len(v.draft), len(v.samples) - 1, j.n_gen + len(v.samples))
        j.phase = "generate"
        effects: list[Effect] = []
        n_live = world.slots[slot].n_live
        for i, s in enumerate(v.samples):
            effects += self._sampled(slot, j, s, world, n_live - (len(v.samples) - 1 - i))
            if self.jobs.get(slot) is not j:
                return effects
        return effects + self._propose(slot, j, world)

    def _done(self, slot: int, j: JobState, world: World, finish: str,
              matched: str | None) -> list[Effect]:
        run = j.job.run_id
        tail = j.matcher.flush() if matched is None else ""
        effects: list[Effect] = [Emit(run, Token(None, tail))] if tail else []
        n, floor = reusable(world.slots[slot])
        effects.append(Emit(run, Done(finish, matched, j.n_gen, n, floor,
                                      j.generating_s - j.started_s,
                                      world.now_s - j.generating_s, j.pending,
                                      self.costs.to_wire(),
                                      j.drafts.summary() if j.drafts is not None else {})))
        return effects + self._finish(slot)

    def _end(self, slot: int, world: World) -> list[Effect]:
        """A cancelled job ends here: what its prefill evaluated stays live (a retry reuses it),
        snapshots taken are still written."""
        j = self.jobs[slot]
        if j.phase in ("start", "follows"):  # nothing of this prompt is in the slot yet
            n, floor = 0, 0
        else:
            n, floor = reusable(world.slots[slot])
        return [Emit(j.job.run_id, Cancelled(n, floor, j.pending)), *self._finish(slot)]

    def _finish(self, slot: int) -> list[Effect]:
        self._ended(self.jobs.pop(slot))
        if slot in self.parked:  # the run its job was nested on, as it was
            self.jobs[slot], self.owners[slot] = self.parked.pop(slot)
            return [Finish(slot), Unpark(slot)]
        later = self.deferred.pop(slot, None)  # a job that could not be nested comes now
        return [Finish(slot), Again(later)] if later is not None else [Finish(slot)]

    def _ended(self, j: JobState) -> JobState:
        for source, t in (j.drafts.totals.items() if j.drafts is not None else ()):
            total = self.drafted.setdefault(source, [0, 0, 0])
            total[:] = [a + b for a, b in zip(total, t, strict=True)]
        return j

