"""Preemption's rules (policies/preempt.py) as exact tables, and the pool's admission around them
(proxy/workers.py: who takes which slot, a promised slot, a run that gave way going first), with
in-memory workers whose runs are stand-ins that report what they have left to prefill: the
real runs through real workers are tests/proxy/test_preempt.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from policies.costs import Costs
from policies.preempt import (
    DECODE_TOKENS,
    PARK_RECHECK_S,
    RATIO,
    Candidate,
    Generating,
    candidate,
    choose_parked,
    choose_victim,
    generating,
    work,
)
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
    generating: tuple[int, int, int] | None = None  # (generated, may still, its state's tokens)

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


async def busy(p: Pool, i: int, left: int | None,
               gen: tuple[int, int, int] | None = None) -> Holder:
    s = p.slots[i]
    s.busy = True
    h = Holder(left, generating=gen)
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


@pytest.mark.parametrize("candidates,want", [
    ([], None),  # nothing generates
    ([Generating(0, 2 * 400 - 1, 400, 100)], None),  # expected to end within RATIO works
    ([Generating(0, RATIO * 400, 400, 100)], 0),
    # of those that fit, the smallest state (its trip to host RAM and back), then the most
    # ahead, then the lowest id
    ([Generating(0, 5000, 400, 900), Generating(1, 900, 400, 300), Generating(2, 700, 400, 10)],
     1),
    ([Generating(2, 5000, 400, 300), Generating(1, 900, 400, 300)], 2),
])
def test_the_run_parked_for_a_short_request_is_the_smallest_that_goes_on_long_enough(
        candidates: list[Generating], want: int | None) -> None:
    assert choose_parked(candidates) == want


def test_a_run_is_expected_to_go_on_as_long_again_as_it_has_generated() -> None:
    g = generating(0, Costs(), 100, 900, 2100, (0, 230), 12)
    assert (g.ahead, g.work, g.live, g.seconds) == (100 * DECODE_TOKENS, work(230, 12), 2100,
                                                     False)
    assert generating(0, Costs(), 100, 30, 2100, (0, 230), 12).ahead == 30 * DECODE_TOKENS, \
        "at most what its max_tokens leaves"
    gpu = Costs()
    for _ in range(4):  # 0.1 ms a prompt token, 20 ms a step
        gpu = gpu.add_prefill(0, 1000, 0.1).add_decode(0.02)
    g = generating(0, gpu, 100, 900, 2100, (0, 230), 12)
    assert g.seconds and g.ahead == pytest.approx(2.0) and g.work == pytest.approx(0.023 + 0.24)


async def test_a_short_request_runs_nested_on_a_generating_slot_which_its_run_gets_back() -> None:
    """Rule 4: every slot generates; a short request takes the slot of the run with the
    smallest state expected to go on long enough, nested; at its end the slot is its run's
    again, and free only once both ended, in either order."""
    p = pool()
    await busy(p, 0, None, (100, 900, 5000))
    await busy(p, 1, None, (100, 900, 2000))
    nest = await p.acquire(list(range(200)), 0, "", 12)
    assert nest.outer is p.slots[1] and p.slots[1].nested is nest and nest.busy
    assert nest.label == "0.1+nested" and nest.view(0, [1], "").busy
    later = asyncio.create_task(p.acquire(list(range(200)), 0, "", 12))
    await asyncio.sleep(0.01)
    assert later.done() and (await later).outer is p.slots[0], "one job nested a slot"
    await p.release(nest, list(range(210)))
    assert p.slots[1].busy and p.slots[1].nested is None and p.slots[1].live_ids == ()
    await p.release(p.slots[0], list(range(5)))  # its run ends before the job nested on it
    assert p.slots[0].busy and p.slots[0].ended and list(p.slots[0].live_ids) == list(range(5))
    third = asyncio.create_task(p.acquire([9], 0, "", 10**6))  # too long to nest
    await asyncio.sleep(0.01)
    assert not third.done(), "a slot stays busy while a job is nested on it"
    await p.release((await later), [])
    assert await third is p.slots[0] and not p.slots[0].ended


async def test_no_run_is_parked_that_ends_soon_without_a_ram_tier_or_nested_already() -> None:
    for p, gen in ((pool(), (10, 900, 500)), (pool(ram_tier=False), (100, 900, 500))):
        await busy(p, 0, None, gen)
        await busy(p, 1, None)  # prefilling, not long enough to give way
        waiter = asyncio.create_task(p.acquire([1, 2, 3], 0, "", 12))
        await asyncio.sleep(0.01)
        assert not waiter.done() and p.slots[0].nested is None
        waiter.cancel()
    p = pool(1)
    await busy(p, 0, None, (100, 900, 500))
    first = await p.acquire([1, 2, 3], 0, "", 12)
    second = asyncio.create_task(p.acquire([1, 2, 3], 0, "", 12))
    await asyncio.sleep(0.01)
    assert first.outer is p.slots[0] and not second.done(), "one nested job a slot"
    await p.release(first, [])
    assert (await asyncio.wait_for(second, 1)).outer is p.slots[0], \
        "the next short request nests once the first ended"


async def test_a_waiter_asks_again_as_the_runs_generate() -> None:
    p = pool(1)
    h = await busy(p, 0, None, (2, 900, 500))  # too soon: 2 tokens ahead of a 35-token work
    waiter = asyncio.create_task(p.acquire([1, 2, 3], 0, "", 2))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    h.generating = (100, 900, 590)  # no event: the waiter looks again by itself
    nest = await asyncio.wait_for(waiter, 4 * PARK_RECHECK_S)
    assert nest.outer is p.slots[0]
