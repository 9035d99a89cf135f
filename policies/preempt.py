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
- the short request runs there at once: its worker, having stopped the run, holds its next step
  up to ``HANDOVER_S`` for the short request's job (which comes once the proxy has seen the
  run end, a few milliseconds later), rather than start another slot's step that the job would
  then wait for (a prefill batch deep in a context: seconds on a CPU);
- the stopped run goes first in the queue (`proxy.workers.Pool.acquire`) and starts again from
  its prefix in the RAM tier on the first slot that frees: its client sees a later first token,
  never a different answer (a restored prefix is bit for bit the cold run's).

Rules, pure (the pool asks, for a request that finds no idle ready slot):

1. The waiter's work and each candidate's prefill left, in one unit per worker: seconds where
   the worker has measured its prefill and its decode steps (`policies.costs`: the tokens the
   waiter must prefill, plus a decode step for each token its ``max_tokens`` allows, a bound so
   the rule holds in the worst case), else prefill tokens, ``DECODE_TOKENS`` for a generated
   one (a fresh worker). So a GPU, where a generated token costs a hundred prompt tokens or
   more, preempts for fewer requests than a CPU does.
2. A candidate is a busy slot whose run has produced no token, has not given way before (at most
   once per request), and whose worker has a RAM tier (without one its prefix would be lost).
3. Of the candidates whose prefill left is at least ``RATIO`` times the waiter's work (shortest
   remaining work first, with room for the state's trip to RAM and back), the one with the
   most left for that work is preempted; otherwise none, and the waiter queues as before.
4. Where none is (every slot generates, as when an agent and its subagents all answer and a
   title or a summary comes), a generating run may be *parked* for the waiter: its worker keeps
   its state byte for byte in host RAM between two of its decode steps, runs the waiter's job
   nested on that slot, and puts the run back at that job's end (`backend.worker.core`); the
   run's tokens pause for the waiter's work, its answer never changes. What a run still has to
   generate is unknown: it is taken as much again as it has generated (a run that has gone
   for g tokens is as likely to stop before 2g as after, the scale-free guess), at most what
   its `max_tokens` leaves, a decode step a token (rule 1's unit). Of the runs expected to go
   on for at least ``RATIO`` times the waiter's work, whose worker has a RAM tier (a state in
   host RAM is within its memory) and which no job is nested on yet, the one whose state is
   smallest (its trip to host RAM and back) is parked; otherwise none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.costs import Costs

# a generated token's cost in prefill tokens until the worker has measured both: a decode step
# evaluates one token through all the weights, which a prefill batch shares among hundreds (on
# 2 CPU cores about 30 for the default model: 88 ms a token against 2.8 ms a prompt token,
# bench/results/issue41; far more on a GPU)
DECODE_TOKENS = 16
RATIO = 2  # the victim's prefill left, against the waiter's work
# the longest a worker holds its next step for the short request's job after a preemption's
# cancel: the round trip through the proxy (the run's end read, its slot handed on, the job
# sent) takes milliseconds; a job that has not come by then does not hold the other slots longer
HANDOVER_S = 0.25
# how often a request that waits for a slot asks rule 4 again: the runs generate meanwhile, and
# what each is expected to go on for grows with what it has generated
PARK_RECHECK_S = 0.25


@dataclass(frozen=True, slots=True)
class Candidate:
    slot_id: int
    left: float  # its run's prefill left (it has produced no token), in its worker's unit
    work: float  # the waiter's work on that worker, in the same unit
    seconds: bool = False  # the unit: seconds as measured, else prefill tokens


def work(prefill: int, max_tokens: int) -> int:
    """Rule 1 on a worker that has measured nothing yet: a request's work in prefill tokens."""
    return max(prefill, 0) + DECODE_TOKENS * max(max_tokens, 0)


def measured(costs: Costs | None) -> Costs | None:
    """Rule 1's unit: the worker's costs where it has measured its prefill and its decode
    steps (seconds), else None (prefill tokens)."""
    return costs if costs is not None and costs.prefill.n and costs.decode.n else None


def waiter_work(costs: Costs | None, waiter: tuple[int, int], max_tokens: int) -> float:
    """Rule 1: the work of a waiter that must prefill positions `waiter` (from, to) and may
    generate `max_tokens`, in its worker's unit."""
    start, end = waiter
    c = measured(costs)
    if c is not None:
        return c.prefill_s(start, end) + max(max_tokens, 0) * c.decode_step_s()
    return float(work(end - start, max_tokens))


def candidate(slot_id: int, costs: Costs | None, done: int, total: int,
              waiter: tuple[int, int], max_tokens: int) -> Candidate:
    """Rule 1: a run that has `done` of its `total` prompt tokens in its KV, against a
    waiter."""
    c, w = measured(costs), waiter_work(costs, waiter, max_tokens)
    if c is not None:
        return Candidate(slot_id, c.prefill_s(done, total), w, True)
    return Candidate(slot_id, float(total - done), w)


def choose_victim(candidates: Sequence[Candidate]) -> int | None:
    """Rule 3: the slot to preempt, or None."""
    fit = [c for c in candidates if c.left >= RATIO * max(c.work, 1e-9)]
    best = max(fit, key=lambda c: (c.left / max(c.work, 1e-9), -c.slot_id), default=None)
    return None if best is None else best.slot_id


@dataclass(frozen=True, slots=True)
class Generating:
    slot_id: int
    ahead: float  # its generation expected still (rule 4), in its worker's unit
    work: float  # the waiter's work on that worker, in the same unit
    live: int  # the tokens its state holds (prompt and generated)
    seconds: bool = False


def generating(slot_id: int, costs: Costs | None, generated: int, left: int, live: int,
               waiter: tuple[int, int], max_tokens: int) -> Generating:
    """Rule 4: a run that has generated `generated` tokens and may generate `left` more, its
    state `live` tokens, against a waiter as in rule 1."""
    ahead = min(generated, max(left, 0))
    c, w = measured(costs), waiter_work(costs, waiter, max_tokens)
    if c is not None:
        return Generating(slot_id, ahead * c.decode_step_s(), w, live, True)
    return Generating(slot_id, float(ahead * DECODE_TOKENS), w, live)


def choose_parked(candidates: Sequence[Generating]) -> int | None:
    """Rule 4: the slot whose run is parked for the waiter, or None."""
    fit = [c for c in candidates if c.ahead >= RATIO * max(c.work, 1e-9)]
    best = min(fit, key=lambda c: (c.live, -c.ahead, c.slot_id), default=None)
    return None if best is None else best.slot_id
