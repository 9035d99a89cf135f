"""Who gives a busy slot to a short request that finds none idle (policies/preempt.py), on the
pool's slots (proxy.workers.Pool.acquire, under its lock): a run still prefilling a long prompt
gives way (rules 1-3), or a run that generates is parked and the request runs nested on its
slot (rule 4); and how a slot frees when a job was nested on it."""

from __future__ import annotations

import logging

from policies.preempt import candidate, choose_parked, choose_victim, generating
from proxy.worker_link import Slot

log = logging.getLogger("prefixgate.workers")


def idle(slots: list[Slot]) -> bool:
    """A slot is free (the router chose to wait for a busy one that holds the prefix): no run
    gives way."""
    return any(s.ready and not s.busy and s.reserved is None for s in slots)


def preempt(slots: list[Slot], me: object, waiter: tuple[int, int], max_tokens: int) -> bool:
    """No idle slot: a run still prefilling a long prompt gives its slot to this short
    request (policies/preempt.py); the slot is promised to it. False: none may."""
    lefts = {i: (left, s.holder.progress[0]) for i, s in enumerate(slots)
             if s.ready and s.busy and s.reserved is None and s.worker.ram_tier
             and s.worker.exact and s.holder is not None
             and (left := s.holder.left) is not None}
    candidates = [candidate(i, slots[i].worker.costs, total - left, total, waiter,
                            max_tokens) for i, (left, total) in lefts.items()]
    victim = choose_victim(candidates)
    if victim is None or not slots[victim].holder.give_way():
        return False
    s = slots[victim]
    s.reserved = me
    c = next(c for c in candidates if c.slot_id == victim)
    log.info("preempt: a request of %d tokens to prefill (%d to generate at most: %s) asks "
             "slot %s of a run with %d tokens left to prefill%s to give way; that run then "
             "runs again from its prefix in the RAM tier", waiter[1] - waiter[0], max_tokens,
             f"{c.work:.2f} s" if c.seconds else f"{c.work:.0f} token-equivalents",
             s.label, lefts[victim][0], f" ({c.left:.2f} s)" if c.seconds else "")
    return True

def park(slots: list[Slot], waiter: tuple[int, int], max_tokens: int) -> Slot | None:
    """No idle slot and no run prefilling long enough to give way: a run that generates
    parked for this short request, which runs nested on its slot (policies/preempt.py
    rule 4); None where none may be."""
    runs = {i: g for i, s in enumerate(slots)
            if s.ready and s.busy and s.reserved is None and s.nested is None
            and not s.ended and s.worker.ram_tier and s.holder is not None
            and (g := s.holder.generating) is not None}
    chosen = choose_parked([generating(i, slots[i].worker.costs, *g, waiter, max_tokens)
                            for i, g in runs.items()])
    if chosen is None:
        return None
    s = slots[chosen]
    s.nested = Slot(s.worker, s.index, outer=s)
    log.info("park: a request of %d tokens to prefill (%d to generate at most) runs nested "
             "on slot %s, whose run (%d tokens generated, %d in its state) waits in host RAM "
             "until it ends", waiter[1] - waiter[0], max_tokens, s.label, runs[chosen][0],
             runs[chosen][2])
    return s.nested


def free(s: Slot) -> None:
    """Its run is over: a slot another job is nested on stays busy until that job ends; a
    nested job's end gives the slot back to its run, or frees it where that run ended."""
    o = s.outer
    if o is not None:
        o.nested = None
        if o.ended:
            o.busy, o.holder, o.ended = False, None, False
    s.holder = None
    if s.nested is not None:
        s.ended = True
    else:
        s.busy = False
