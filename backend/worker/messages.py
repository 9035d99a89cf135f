"""What the worker's core is told and what it asks for (`backend.worker.core.Core.apply`):
plain frozen values, no I/O.

- `World`: what each slot's live KV and the worker's memory hold, read just before an input is
  applied.
- Inputs: a job arrived or was cancelled, or the result of an effect came back (`Loaded`,
  `ReadDone`, `Stepped`, `Sampled`, `Snapshotted`, `Failed`), or a verify step's samples
  (`Verified`) or its batch of a draft model's prompt (`Filling`).
- Effects, each on the thread it belongs to (`backend.worker.loop`): `Emit` an event to a run's
  stream; on the compute thread `GiveWay`, `Load`, `Cut`, `Snapshot`, `StartSampling`, `Sample`,
  `Finish`, `Park`, `Unpark`; on the reader thread `Read`; `Again` back into the inbox.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from backend.protocol import Event, Fault, Job
from policies.decide import Save
from policies.prefix import Batching, Edges, live_reuse
from policies.sources import Candidate, Tier

Ids = npt.NDArray[np.intc]


# --- what the core is told ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Live:
    """What a slot's live KV holds (the engine's `Seq`), read just before `apply`."""

    ids: Ids  # ids[:n_live]
    n_live: int
    exact_n: int  # its leading tokens whose KV a cold prefill computes identically
    floor: int  # the shortest live prefix its memory can be cut back to
    nbytes: int = 0  # its state's size


def shared_edge(other: Ids, ids: Ids, edges: Edges, n: int) -> int:
    """The last batch edge of the prompt `ids` (`edges`) within the first `n` tokens it shares
    with `other` (n at most both lengths)."""
    differ = np.flatnonzero(other[:n] != ids[:n])
    return edges.floor(int(differ[0]) if len(differ) else n)


def live_prefix(live: Live, ids: Ids, edges: Edges, limit: int | None = None) -> int:
    """Tokens of the prompt `ids` the live KV holds exactly and can be cut back to, at a batch
    edge of the prompt (`edges`), at most `limit`."""
    n = min(live.exact_n, len(ids))
    if n == 0:
        return 0
    kept = live_reuse(shared_edge(live.ids, ids, edges, n), live.n_live, live.floor)
    return kept if limit is None else min(kept, limit)


def reusable(live: Live) -> tuple[int, int]:
    """(live tokens a next request may keep, the shortest of them the memory can be cut back
    to). Generated tokens are not exact, so where the memory cannot be cut back to the exact
    part (a recurrent state after generating), none."""
    n, floor = live.exact_n, live.floor
    if n < live.n_live and n < floor:
        return 0, 0
    return n, min(floor, n)


@dataclass(frozen=True, slots=True)
class Held:
    """A state in the worker's memory: a RAM-tier entry or a snapshot waiting for its file."""

    tier: Tier  # ram | queued
    ref: int  # the tier's own handle on it
    salt: bytes
    tenant: str
    ids: Ids  # exactly the tokens it holds
    nbytes: int


@dataclass(frozen=True, slots=True)
class World:
    slots: Sequence[Live]
    held: Sequence[Held] = ()
    now_s: float = 0.0


def give_way(batching: Batching, owner: tuple[str, bytes], slot: int, job: Job, ids: Ids,
             keep: int, live: Live) -> list[GiveWay]:
    """The part of the slot's live KV (`owner`'s) a next request could reuse, cut back to a
    batch edge, before `job` (keeping `keep` of it) replaces it; not where this prompt extends
    all of it."""
    n = min(live.exact_n, live.n_live) if not (live.exact_n < live.n_live
                                                and live.exact_n < live.floor) else 0
    if n > keep:
        n = batching.edges(live.ids[:n].tolist()).floor(n)
    tenant, salt = owner
    if n <= keep or live_reuse(n, live.n_live, live.floor) != n or (
            owner == (job.tenant, job.salt) and len(ids) >= n
            and np.array_equal(live.ids[:n], ids[:n])):
        return []
    return [GiveWay(slot, n, salt, tenant)]


def in_memory(slot: int, job: Job, ids: Ids, edges: Edges, limit: int, world: World,
              owners: Sequence[tuple[str, bytes]], cuts: bool, ram_budget: int
              ) -> list[Candidate]:
    """Candidates in the worker's memory for a job on `slot`, of its salt and tenant: held
    states and other slots' live KV (its exact part; `owners`: each slot's), each up to the
    last batch edge it shares with the prompt. A part of a state only where the memory `cuts`
    and there is a RAM tier; a copy of a live slot passes through host RAM: none larger than
    the budget."""
    out = []
    sources: list[tuple[Tier, int, Ids, int, bool]] = [
        (h.tier, h.ref, h.ids, h.nbytes, True) for h in world.held
        if h.salt == job.salt and h.tenant == job.tenant]
    sources += [("slot", s, live.ids[: live.exact_n], live.nbytes,
                 live.n_live == live.exact_n)  # its state ends where its exact part does
                for s, live in enumerate(world.slots)
                if s != slot and live.exact_n and owners[s] == (job.tenant, job.salt)
                and 0 < live.nbytes and (ram_budget < 0 or live.nbytes <= ram_budget)]
    for tier, ref, src, nbytes, ends in sources:
        e = shared_edge(src, ids, edges, min(len(src), len(ids), limit))
        whole = e == len(src) and ends
        if e > 0 and (whole or (cuts and ram_budget != 0)):
            out.append(Candidate(tier, e, whole, nbytes, ref))
    return out


@dataclass(frozen=True, slots=True)
class Arrive:
    job: Job


@dataclass(frozen=True, slots=True)
class CancelRun:
    run_id: str
    prefilling: bool = False  # only while it has not sampled (a preemption: see proxy.run)


@dataclass(frozen=True, slots=True)
class Loaded:
    """A `Load` ran: the slot holds `kept` tokens of the candidate (0 with `fault`)."""

    slot: int
    run_id: str
    candidate: Candidate
    kept: int
    seconds: float
    fault: Fault | None = None


@dataclass(frozen=True, slots=True)
class ReadDone:
    """A `Read` came back: `payload` is the state, verified and prepared, for `Load`."""

    slot: int
    run_id: str
    index: int  # in job.plan.restore
    payload: Any
    seconds: float
    fault: Fault | None = None
    pulled: Event | None = None  # the `Saved` of an entry pulled from the shared tier


@dataclass(frozen=True, slots=True)
class Stepped:
    """A prefill batch or a decode step evaluated this slot's tokens (`seconds`: its share)."""

    slot: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Sampled:
    slot: int
    token: int
    piece: bytes
    eog: bool


@dataclass(frozen=True, slots=True)
class Verified:
    """A verify step evaluated the slot's waiting token and its draft (`seconds`: its share)
    and sampled its rows: `samples`, the accepted drafts and the step's last token, in order;
    the KV holds the waiting token and the accepted drafts."""

    slot: int
    seconds: float
    samples: tuple[Sampled, ...]
    draft: tuple[int, ...]  # the tokens verified after the waiting one


@dataclass(frozen=True, slots=True)
class Filling:
    """A verify step prefilled a batch of the slot's draft model's prompt instead (`seconds`:
    the step's); its token waits for its first draft."""

    slot: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Snapshotted:
    run_id: str
    queued: bool  # a write began (false: the same state waits for its file already)


@dataclass(frozen=True, slots=True)
class Failed:
    slot: int
    message: str


Input = (Arrive | CancelRun | Loaded | ReadDone | Stepped | Sampled | Snapshotted | Failed
         | Verified | Filling)


# --- what the core asks for ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Emit:
    run_id: str
    event: Event


@dataclass(frozen=True, slots=True)
class GiveWay:
    """Copy the slot's live KV, cut back to `n`, to the RAM tier under its owner's keys."""

    slot: int
    n: int
    salt: bytes
    tenant: str


@dataclass(frozen=True, slots=True)
class Load:
    """Load a candidate into the slot and cut it back to `n` (the compute thread): another
    slot's live KV, a held state (`ref`), or a read's `payload`."""

    slot: int
    run_id: str
    candidate: Candidate
    n: int
    src: int = -1  # the slot copied from (tier slot)
    payload: Any = None  # a read's state (tiers disk and shared)


@dataclass(frozen=True, slots=True)
class Read:
    """Read, verify and prepare a disk or shared entry (the reader thread)."""

    slot: int
    run_id: str
    job: Job
    index: int  # in job.plan.restore


@dataclass(frozen=True, slots=True)
class Cut:
    slot: int
    n: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Snapshot the slot's first `n` tokens (behind: cut back from the live KV, which is put
    back) and write it (the writer thread)."""

    slot: int
    run_id: str
    n: int
    save: Save
    behind: bool = False


@dataclass(frozen=True, slots=True)
class StartSampling:
    slot: int
    sampling: dict[str, Any]
    grammar: str | None


@dataclass(frozen=True, slots=True)
class Sample:
    slot: int


@dataclass(frozen=True, slots=True)
class Finish:
    """The slot's job is over: free its sampler; it takes a new job."""

    slot: int


@dataclass(frozen=True, slots=True)
class Park:
    """Keep the slot's generating run aside for a nested job: its whole state copied to host
    RAM (byte for byte) with its sequence's fields and its sampler, the slot emptied."""

    slot: int


@dataclass(frozen=True, slots=True)
class Unpark:
    """Put the slot's parked run back as it was (after its nested job's `Finish`)."""

    slot: int
    drop: bool = False  # its run ended while parked: free what was kept, restore nothing


@dataclass(frozen=True, slots=True)
class Again:
    """The job arrives again (a nested job that waited for its slot's run to end)."""

    job: Job


Effect = (Emit | GiveWay | Load | Read | Cut | Snapshot | StartSampling | Sample | Finish | Park
          | Unpark | Again)
