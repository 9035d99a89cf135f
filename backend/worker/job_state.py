"""One slot's job as the worker's core keeps it (`backend.worker.core`): plain state, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.protocol import Event, Fault, Job
from backend.stops import StopMatcher
from backend.worker.drafts import SlotDrafts
from backend.worker.messages import Ids
from policies.decide import Save
from policies.prefix import Edges
from policies.sources import Candidate, Tier


@dataclass(slots=True)
class JobState:
    job: Job
    ids: Ids
    edges: Edges
    limit: int  # reuse at most this many tokens
    mine: bool  # the live KV may be kept (the plan allows it, it is this tenant's)
    keep: int  # what the live KV holds of the prompt that it keeps
    started_s: float  # when it came to the worker
    order: list[Candidate] = field(default_factory=list)  # what is left to try
    faults: list[Fault] = field(default_factory=list)
    pulled: list[Event] = field(default_factory=list)  # `Saved` of entries pulled
    read_s: float = 0.0  # the reader's seconds for the candidate being loaded
    source: Tier = "live"
    restored: int = 0  # tokens restored from the disk or the shared tier
    from_memory: int = 0  # tokens restored from memory (another slot, a held state)
    saves: dict[int, Save] = field(default_factory=dict)
    pending: int = 0  # writes begun
    phase: str = "start"  # start | follows | prefill | generate | waits
    prefill_from: int = 0
    busy_s: float = 0.0  # seconds its prefill batches took
    generating_s: float = 0.0  # when its generation began
    matcher: StopMatcher = field(default_factory=lambda: StopMatcher(()))
    n_gen: int = 0
    token: int = -1  # the sampled token that waits for its decode
    came_s: float = 0.0  # when its request came to the server (the worker's clock)
    drafts: SlotDrafts | None = None  # its speculation, while it generates
    fills: bool = False  # its draft model prefills its prompt (a `Filling` came, no step yet)
    leader: tuple[int, str, int] = (-1, "", 0)  # it follows: (slot, run, tokens it waits for)
