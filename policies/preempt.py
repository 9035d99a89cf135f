"""Preemption: which run still prefilling gives its slot to a short request that found none.

A request that comes when every ready slot is busy waits for one: as long as the runs before it
take. For a title or a summary (a few hundred tokens, a few to generate) beside subagents each
prefilling thousands of tokens of a cold prompt, that is most of a minute on a CPU and seconds
on a GPU, for a request that needs a second. llama-server gives such a request the first slot
that frees; here it may take the slot of a run still prefilling a long prompt:

- that run stops at its next batch edge (`POST /cancel` with "prefilling": a run that has
  sampled is never stopped), its prefix is a cold run's state at a batch edge (the cache's own
  invariant: `backend.worker.core`), which gives way to its worker's RAM tier when the short
  request takes the slot;
- the short request runs there at once;
- the stopped run goes first in the queue (`proxy.workers.Pool.acquire`) and starts again from
  its prefix in the RAM tier on the first slot that frees: its client sees a later first token,
  never a different answer (a restored prefix is bit for bit the cold run's).

Rules, pure (the pool asks, for a request that finds no idle ready slot):

1. The waiter's work, in prefill tokens: the tokens it must prefill plus ``DECODE_TOKENS`` per
   token it may generate (its ``max_tokens``: a bound, so the rule holds in the worst case).
2. A candidate is a busy slot whose run has produced no token, has not given way before (at most
   once per request), and whose worker has a RAM tier (without one its prefix would be lost).
3. The candidate with the most prefill left is preempted if that is at least ``RATIO`` times the
   waiter's work (shortest remaining work first, with room for the state's trip to RAM and
   back); otherwise none, and the waiter queues as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# a generated token's cost in prefill tokens: a decode step evaluates one token through all the
# weights, which a prefill batch shares among hundreds (on 2 CPU cores about 30 for the
# default model: 88 ms a token against 2.8 ms a prompt token, bench/results/issue41; far more
# on a GPU, where a title's answer is still short)
DECODE_TOKENS = 16
RATIO = 2  # the victim's prefill left, against the waiter's work


@dataclass(frozen=True, slots=True)
class Candidate:
    slot_id: int
    left: int  # prompt tokens its run has still to prefill (it has produced no token)


def work(prefill: int, max_tokens: int) -> int:
    """Rule 1: a request's work in prefill tokens."""
    return max(prefill, 0) + DECODE_TOKENS * max(max_tokens, 0)


def choose_victim(waiter_work: int, candidates: Sequence[Candidate]) -> int | None:
    """Rule 3: the slot to preempt for a waiter of this work, or None."""
    best = max(candidates, key=lambda c: (c.left, -c.slot_id), default=None)
    if best is None or best.left < RATIO * max(waiter_work, 1):
        return None
    return best.slot_id
