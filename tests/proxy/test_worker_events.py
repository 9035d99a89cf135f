"""The proxy's view of a worker's RAM tier comes from the worker's own tier events (issue 41),
not from guesses: a real `prefixgate worker` process, the proxy's real `Pool` listening to its
`GET /events`. A live state that gives way enters the view with exactly the tokens it holds; a
state restored whole leaves it; the router counts what the RAM tier holds of a prompt; a
restarted worker's view starts empty."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.protocol import Done, Job, Start, TierEvent
from policies.decide import Plan
from policies.prefix import keep_max
from proxy.config import Config
from proxy.worker_link import Worker, slot_views
from proxy.workers import Pool
from tests.conftest import N_CTX, free_port
from tests.deploy.test_remote_workers import WorkerProcess
from tests.models import BATCH

pytestmark = pytest.mark.model

A = tuple(range(1000, 1000 + 3 * BATCH + 9))  # no end-of-turn id: edges at multiples of BATCH
B = tuple(range(5000, 5000 + 2 * BATCH + 5))


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[WorkerProcess]:
    w = WorkerProcess(tmp_path, free_port(), tmp_path / "cache", "--cache-ram", "64")
    try:
        yield w
    finally:
        w.stop()


async def _run(pool: Pool, ids: tuple[int, ...]) -> list[object]:
    slot = await pool.acquire(list(ids), 0)
    events: list[object] = []
    plan = Plan((), (), keep_max(len(ids), BATCH), True, "off", None, None)
    job = Job(f"r{len(ids)}", ids, b"", "", plan, {"temperature": 0.0}, 2, (), None, slot.index)
    async with slot.run(job, 120) as stream:
        while not isinstance(ev := await stream.next(), Done):
            events.append(ev)
    await pool.release(slot, list(ids)[: ev.n_live], "", floor=ev.floor)
    return events


async def _until(check: object, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the view never came to hold it")


async def test_the_pools_view_of_the_ram_tier_follows_the_workers_events(
        worker: WorkerProcess, tmp_path: Path) -> None:
    cfg = dataclasses.replace(Config(), worker_url=(worker.url,), n_ctx=N_CTX,
                              cache_dir=str(tmp_path / "cache"), disk_prefix_cache="off")
    pool = Pool(cfg)
    await pool.start()
    try:
        w: Worker = pool.workers[0]
        await _run(pool, A)
        assert w.ram == {}, "nothing gave way yet"
        await _run(pool, B)  # A's state gives way to the RAM tier, cut to a batch edge
        await _until(lambda: len(w.ram) == 1)
        (tenant, held), = w.ram.values()
        assert (tenant, held) == ("", A[: 3 * BATCH])
        # the router counts it: any idle slot of this worker can start A from there
        (view,) = slot_views(pool.slots, list(A), "")
        assert view.borrow == 3 * BATCH and view.live_prefix == 0
        start = next(e for e in await _run(pool, A) if isinstance(e, Start))
        assert (start.keep, start.ram) == (3 * BATCH, 3 * BATCH), "restored from RAM"
        # A's entry was taken whole (the slot holds it); B's state gave way in its place
        await _until(lambda: [h for _, h in w.ram.values()] == [B[: 2 * BATCH]])
    finally:
        await pool.close()


async def test_a_slots_live_kv_is_said_when_a_job_ends_and_when_the_next_replaces_it(
        worker: WorkerProcess, tmp_path: Path) -> None:
    # what a KV-aware router is told of a slot (proxy/kv_events.py): the prompt's tokens the
    # slot holds exactly, cut back to a batch edge, never the generated ones
    cfg = dataclasses.replace(Config(), worker_url=(worker.url,), n_ctx=N_CTX,
                              cache_dir=str(tmp_path / "cache"), disk_prefix_cache="off")
    pool = Pool(cfg)
    live: list[TierEvent] = []
    pool.on_tier = lambda source, ev: live.append(ev) if ev and ev.tier == "live" else None
    await pool.start()
    try:
        await _run(pool, A)
        await _until(lambda: len(live) == 1)
        await _run(pool, B)  # A's KV is cut back to nothing kept, then holds B's prompt
        await _until(lambda: len(live) == 3)
        assert [(e.kind, e.ref, e.ids) for e in live] == [
            ("stored", 0, A[: 3 * BATCH]), ("removed", 0, ()), ("stored", 0, B[: 2 * BATCH])]
    finally:
        await pool.close()
