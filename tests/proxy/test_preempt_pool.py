"""Preemption's rules (policies/preempt.py) as exact tables, and the pool's admission around them
(proxy/workers.py: who takes which slot, a promised slot, a run that gave way going first), with
in-memory workers whose runs are stand-ins that report what they have left to prefill: the
real runs through real workers are tests/proxy/test_preempt.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from policies.costs import Costs
from policies.preempt import DECODE_TOKENS, RATIO, Candidate, candidate, choose_victim, work
from proxy.config import Config
from proxy.worker_link import Slot, Worker
from proxy.workers import Pool


def test_a_requests_work_counts_what_it_may_generate() -> None:
    assert work(230, 12) == 230 + DECODE_TOKENS * 12
    assert work(-5, -1) == 0


def test_a_worker_that_measured_its_costs_compares_seconds() -> None:
    """Rule 1: tokens until the worker measured its prefill and decode steps, then seconds: a
    GPU's decode step, worth hundreds of prompt tokens, keeps a title from taking a slot whose
    prefill it would hold up longer than it waits."""
    fresh = candidate(0, Costs(), 1000, 3000, (0, 230), 12)
    assert (fresh.left, fresh.work, fresh.seconds) == (2000, work(230, 12), False)
    cpu = Costs()
    for _ in range(4):  # 3 ms a prompt token, 90 ms a decode step
        cpu = cpu.add_prefill(0, 1000, 3.0).add_decode(0.09)
    c = candidate(0, cpu, 1000, 3000, (0, 230), 12)
    assert c.seconds and c.left == pytest.approx(6.0) and c.work == pytest.approx(0.69 + 1.08)
    assert choose_victim([c]) == 0
    gpu = Costs()
    for _ in range(4):  # 0.1 ms a prompt token, 20 ms a step: 12 steps outweigh 2000 tokens
        gpu = gpu.add_prefill(0, 1000, 0.1).add_decode(0.02)
    assert choose_victim([candidate(0, gpu, 1000, 3000, (0, 230), 12)]) is None


@pytest.mark.parametrize("candidates,want", [
    ([], None),  # nothing is prefilling
    ([Candidate(0, 799, 400)], None),  # less than RATIO times the waiter's work left
    ([Candidate(0, RATIO * 400, 400)], 0),
    ([Candidate(0, 900, 400), Candidate(2, 3000, 400), Candidate(1, 3000, 400)], 1),  # most
    # left for the work, the lowest id on a tie
    ([Candidate(0, 4.0, 1.0, True), Candidate(1, 3000, 400)], 1),  # each in its worker's unit
    ([Candidate(3, 2, 0)], 3),  # a request with nothing to do
    ([Candidate(0, 10**6, 10**9)], None),  # an unbounded max_tokens never preempts
])
def test_the_run_with_the_most_prefill_left_for_the_work_gives_way(
        candidates: list[Candidate], want: int | None) -> None:
    assert choose_victim(candidates) == want


@dataclass
class Holder:
    """A run as the pool sees it: what it has left to prefill while it may give way."""

    left: int | None
    asked: int = 0
    total: int = 4000

    @property
    def progress(self) -> tuple[int, int]:
        return self.total, self.total - (self.left or 0)

    def give_way(self) -> bool:
        self.asked += 1
        ok, self.left = self.left is not None, None
        return ok


def pool(slots: int = 2, ram_tier: bool = True) -> Pool:
    p = Pool(Config())
    w = Worker(0, "http://w0", ready=True, ram_tier=ram_tier)
    w.set_slots(slots)
    p.workers = [w]
    return p


async def busy(p: Pool, i: int, left: int | None) -> Holder:
    s = p.slots[i]
    s.busy = True
    h = Holder(left)
    await p.hold(s, h)
    return h


async def test_a_short_request_takes_the_slot_of_a_long_prefill_and_the_run_goes_first() -> None:
    p = pool()
    long = await busy(p, 0, 3000)
    other = await busy(p, 1, 500)
    short = asyncio.create_task(p.acquire(list(range(200)), 0, "", 12))
    await asyncio.sleep(0.01)
    assert (long.asked, other.asked) == (1, 0) and p.slots[0].reserved is not None
    # the long run gave way: its slot goes to the short request, not to a request that came
    # meanwhile; the long run, queued again, takes the next slot that frees before that one
    later = asyncio.create_task(p.acquire(list(range(300)), 0, "", 12))
    await p.release(p.slots[0], list(range(1000)))
    assert await short is p.slots[0]
    again = asyncio.create_task(p.acquire(list(range(3200)), 0, "", first=True))
    await asyncio.sleep(0.01)
    assert not later.done() and not again.done() and other.asked == 0, \
        "the later request does not preempt the other (its left is short)"
    await p.release(p.slots[1], [])
    assert await again is p.slots[1]
    await p.release(p.slots[0], [])
    assert await later is p.slots[0]


async def test_no_preemption_without_a_ram_tier_a_slot_idle_or_a_run_that_may_not() -> None:
    for p, held in ((pool(ram_tier=False), 3000), (pool(), None)):
        h = await busy(p, 0, held)
        await busy(p, 1, None)
        waiter = asyncio.create_task(p.acquire([1, 2, 3], 0, "", 1))
        await asyncio.sleep(0.01)
        assert not waiter.done() and p.slots[0].reserved is None and h.asked == 0
        waiter.cancel()
    p = pool()
    await busy(p, 0, 3000)
    assert await p.acquire([1], 0, "", 1) is p.slots[1], "an idle slot first"


async def test_a_yield_that_lapses_lifts_the_promise() -> None:
    p = pool(1)
    await busy(p, 0, 3000)
    short = asyncio.create_task(p.acquire([1, 2], 0, "", 1))
    await asyncio.sleep(0.01)
    assert p.slots[0].reserved is not None
    await p.lapse(p.slots[0])  # the worker had sampled: the run goes on
    assert p.slots[0].reserved is None and not short.done()
    await p.release(p.slots[0], [])
    assert await short is p.slots[0], "it waits for the slot as any request does"


async def test_a_waiter_cancelled_while_promised_a_slot_frees_the_promise() -> None:
    p = pool(1)
    await busy(p, 0, 3000)
    short = asyncio.create_task(p.acquire([1, 2], 0, "", 1))
    await asyncio.sleep(0.01)
    short.cancel()
    await asyncio.gather(short, return_exceptions=True)
    assert p.slots[0].reserved is None
    await p.release(p.slots[0], [])
    assert await p.acquire([5], 0) is p.slots[0]


def test_a_promised_slot_looks_busy_to_the_router() -> None:
    s = Slot(Worker(0, "http://w0", ready=True), 0)
    s.reserved = object()
    assert s.view(0, [1], "").busy
