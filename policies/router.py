"""Routing: which slot runs a prompt, given each slot's live KV and the disk hit.

A slot is one sequence of a worker (`--parallel`); a worker of one slot is one slot. Rules,
among slots of ready workers only (``None`` when there is none):

1. If some ready slot is idle, the best idle one runs the prompt now. A slot is worth what it
   saves minus what it throws away:

       score = max(live_prefix, disk_hit, borrow)  # tokens not prefilled there
               - (live_tokens - live_prefix)       # live tokens of another prompt it drops

   the highest score wins; ties: the longer live prefix, then the least recently used, then
   the lowest ``slot_id``. So a request goes to the slot whose live KV it extends; otherwise
   to an empty slot; otherwise to the slot holding the least. A short background request
   (a title, a summary) never takes a long session's slot while a cheaper one is idle.
   ``borrow`` is what the slot's worker can copy into it from another of its slots (a prompt
   sharing part of another slot's live KV, cut back: `backend.worker.Worker._from_memory`), so a
   subagent that shares its tools with the main session starts from a copy in a free slot
   rather than taking the session's slot and dropping the rest of its KV.
2. A busy slot is worth waiting for only when its live prefix beats both ``disk_hit`` and the
   best idle live prefix or borrow by more than ``margin_tokens`` (default
   ``WAIT_MARGIN_TOKENS`` = 1024): that many tokens of prefill saved is worth a queue wait;
   anything less is not, and waiting would pile sessions onto one slot (the load-imbalance
   guard). Then the busy slot with the longest live prefix is chosen (ties: lowest id) and the
   caller queues on it.
3. If no ready slot is idle, the ready slot with the longest live prefix (ties: lowest id); the
   caller queues on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WAIT_MARGIN_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class SlotView:
    slot_id: int
    live_prefix: int  # tokens of this prompt its live KV already holds (caller computes)
    busy: bool
    ready: bool = True
    live_tokens: int = 0  # tokens its live KV holds (of any prompt)
    used_s: float = 0.0  # when it last ran a request (any clock; only the order matters)
    borrow: int = 0  # tokens of this prompt its worker can copy in from another of its slots


def _longest(slots: Sequence[SlotView]) -> SlotView | None:
    """Longest live prefix, lowest id on ties; None for no slots."""
    return max(slots, key=lambda s: (s.live_prefix, -s.slot_id), default=None)


def score(s: SlotView, disk_hit: int) -> int:
    """Rule 1's worth of an idle slot (module docstring)."""
    return max(s.live_prefix, disk_hit, s.borrow) - max(s.live_tokens - s.live_prefix, 0)


def choose_slot(
    slots: Sequence[SlotView], disk_hit: int, margin_tokens: int = WAIT_MARGIN_TOKENS
) -> int | None:
    """Id of the slot to run (or queue) the prompt on, or ``None`` if no slot is ready."""
    ready = [s for s in slots if s.ready]
    idle = [s for s in ready if not s.busy]
    busy = _longest([s for s in ready if s.busy])
    if not idle:
        return busy.slot_id if busy is not None else None
    best_live = max(max(s.live_prefix, s.borrow) for s in idle)
    if busy is not None and busy.live_prefix > max(disk_hit, best_live) + margin_tokens:
        return busy.slot_id
    return max(idle, key=lambda s: (score(s, disk_hit), s.live_prefix, -s.used_s,
                                    -s.slot_id)).slot_id
