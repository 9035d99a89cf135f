"""The run state machine (proxy/run.py), first as tables of worker events and the exact effects
they produce, then driven by the real `Run` against a fake worker (a real aiohttp app on port 0
that replays scripted events) for the faults a real worker cannot produce on demand: dying in
the middle of a stream, or after `Done` with saves still pending. The commits land in a real
LMDB index; the worker client is the pool's own HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from backend.index import Entry, Index
from backend.keys import CacheIdentity
from backend.protocol import (
    Cancelled,
    Done,
    Error,
    Event,
    Fault,
    Job,
    Kept,
    Prefill,
    Saved,
    SaveFailed,
    Start,
    Token,
    encode_event,
)
from policies.decide import Plan, Restore, Save
from policies.plan import CacheKnobs
from policies.scope import Scope
from proxy.cache import DiskCache
from proxy.chat import ChatRequest
from proxy.config import Config
from proxy.errors import WorkerFailed
from proxy.metrics import Metrics
from proxy.prompt import Prepared
from proxy.run import Run, RunDeps
from proxy.run_state import (
    Abandon,
    Commit,
    Count,
    Drop,
    Emit,
    Fail,
    Finish,
    Lapse,
    LostSaves,
    Progress,
    Record,
    Release,
    Requeue,
    RunState,
    SaveFailure,
    SendCancel,
    Shutdown,
    StreamLost,
    Touch,
    Yield,
)
from proxy.template import Rendered
from proxy.worker_link import Worker
from proxy.workers import Pool
from tests.entries import entry_of

IDS = tuple(range(1000, 1400))  # a 400-token prompt
K300, K100, S300, S400 = b"k300" * 4, b"k100" * 4, b"s300" * 4, b"s400" * 4
# a partial hit: the worker may restore 300 (or fall back to 100); it snapshots the scope
# boundary at 300 (already stored here, but the plan does not know) and the prompt end
PLAN = Plan(restore=(Restore(300, K300, "kv/a.kv"), Restore(100, K100, "kv/b.kv")),
            saves=(Save(300, "scoped"), Save(400, "full")), keep_max=398,
            live_ok=True, lookup="partial", boundary=300, anchor_skipped=None)
BROKEN = Fault("checksum", "checksum mismatch", "kv/a.kv")
SAVED_400 = Saved(400, S400.hex(), "full", "kv/s4.kv", 9000, 7, 0.01)
SAVED_300 = Saved(300, S300.hex(), "scoped", "kv/s3.kv", 7000, 5, 0.01)
FAILED_400 = SaveFailed(400, S400.hex(), "full", "disk_full", "no space left")


def done(n_gen: int, n_live: int, pending: int, finish: str = "length",
         stop: str | None = None) -> Done:
    return Done(finish, stop, n_gen, n_live, 0, 0.5, 0.1, pending)


# (events, expected effects of each event in turn, expected final facts)
CASES: dict[str, tuple[list[Any], list[list[Any]], dict[str, Any]]] = {
    # restored from disk, prefilled to the end, two tokens, both snapshots land after Done
    "disk hit": (
        [Start(300, 300, 0.01, ()), Prefill(398), Token(7, "a"), Token(8, ""),
         done(2, 401, 2), SAVED_400, SAVED_300],
        [[Touch(K300, 0.01)], [Progress(398)], [Emit("a")], [],
         [Finish(), Record(), Release((*IDS, 7))], [Commit(SAVED_400)], [Commit(SAVED_300)]],
        {"outcome": "ok", "closed": True, "cached": 300, "source": "disk", "created": 100},
    ),
    # the longest entry is broken: dropped, and the fallback at 100 was restored instead
    "broken entry, fallback": (
        [Start(100, 100, 0.02, (BROKEN,)), done(0, 400, 0)],
        [[Drop(BROKEN, K300), Touch(K100, 0.02)], [Finish(), Record(), Release(IDS)]],
        {"outcome": "ok", "closed": True, "cached": 100, "source": "disk", "created": 300},
    ),
    # live reuse: nothing restored, no hit counted
    "live reuse": (
        [Start(350, 0, 0.0, ()), done(1, 400, 0)],
        [[], [Finish(), Record(), Release(IDS)]],
        {"outcome": "ok", "closed": True, "cached": 350, "source": "live", "created": 50},
    ),
    # the client left during the prefill: one cancel counted and sent; the worker stops, keeps
    # what it prefilled, and the snapshot it already took is still committed
    "cancel": (
        [Start(0, 0, 0.0, ()), Prefill(128), Abandon(), Cancelled(300, 0, 1), SAVED_300],
        [[], [Progress(128)], [Count("cancelled"), SendCancel()],
         [Finish(), Release(IDS[:300])], [Commit(SAVED_300)]],
        {"outcome": "cancelled", "closed": True, "cached": 0, "source": "none"},
    ),
    # the cancel came too late: the run finished anyway; tokens after it are not emitted, the
    # outcome stays cancelled (counted once, at the cancel) and nothing is recorded as served
    "late cancel": (
        [Start(300, 300, 0.01, ()), Token(7, "a"), Abandon(), Token(8, "b"), done(2, 402, 0),
         Abandon()],
        [[Touch(K300, 0.01)], [Emit("a")], [Count("cancelled"), SendCancel()], [],
         [Finish(), Release((*IDS, 7, 8))], []],
        {"outcome": "cancelled", "closed": True},
    ),
    # the worker died mid-stream: the consumer fails, the worker is released with the prompt
    # tokens its KV held at the last prefill batch (generated ones are not exact)
    "worker dies mid-stream": (
        [Start(0, 0, 0.0, ()), Prefill(256), Token(7, "x"), StreamLost("worker 0 ended")],
        [[], [Progress(256)], [Emit("x")],
         [Fail("worker 0 ended"), Count("error"), Release(IDS[:256], suspect=True)]],
        {"outcome": "error", "closed": True},
    ),
    # the worker reports an error after it started: the same, from its own event
    "worker error": (
        [Start(0, 0, 0.0, ()), Error("RuntimeError: decode failed")],
        [[], [Fail("RuntimeError: decode failed"), Count("error"), Release(())]],
        {"outcome": "error", "closed": True},
    ),
    # the worker refuses the job before it starts: the caller raises and releases the worker
    "refused before start": (
        [Error("malformed job")],
        [[Fail("malformed job")]],
        {"outcome": "", "closed": True},
    ),
    # the stream fails after Done while a snapshot is still being written: that save is lost,
    # the run is closed (the worker was released at Done)
    "lost after done": (
        [Start(300, 300, 0.01, ()), done(0, 400, 2), SAVED_300, StreamLost("reset")],
        [[Touch(K300, 0.01)], [Finish(), Record(), Release(IDS)], [Commit(SAVED_300)],
         [LostSaves("reset")]],
        {"outcome": "ok", "closed": True},
    ),
    # a snapshot that could not be written is counted, never a failed request
    "save failed": (
        [Start(300, 300, 0.01, ()), done(0, 400, 1), FAILED_400],
        [[Touch(K300, 0.01)], [Finish(), Record(), Release(IDS)], [SaveFailure(FAILED_400)]],
        {"outcome": "ok", "closed": True},
    ),
    # the proxy stops while a run streams: the worker goes away too, nothing is live
    "shutdown mid-run": (
        [Start(300, 300, 0.01, ()), Token(7, "a"), Shutdown()],
        [[Touch(K300, 0.01)], [Emit("a")], [Finish(), Count("cancelled"), Release(())]],
        {"outcome": "cancelled", "closed": True},
    ),
    # the proxy stops after Done while a commit is pending (Gateway.close waited for it and
    # gave up): nothing more to do, the run is closed
    "shutdown with a pending commit": (
        [Start(300, 300, 0.01, ()), done(0, 400, 1), Shutdown()],
        [[Touch(K300, 0.01)], [Finish(), Record(), Release(IDS)], []],
        {"outcome": "ok", "closed": True},
    ),
    # a stop string ended the text: finish "stop", and which string it was
    "stop sequence": (
        [Start(300, 300, 0.01, ()), Token(7, "a"), done(1, 401, 0, "stop_sequence", "\nUser:")],
        [[Touch(K300, 0.01)], [Emit("a")], [Finish(), Record(), Release((*IDS, 7))]],
        {"outcome": "ok", "closed": True, "finish": "stop", "stop": "\nUser:"},
    ),
    # a short request takes the slot (policies/preempt.py): the worker stops at its next batch
    # edge; the run ends preempted (nothing counted, the consumer's stream goes on), the
    # worker is released with the prefix it holds, the snapshot taken is still committed, and
    # the driver runs the request again; a second Yield asks nothing
    "preempted while prefilling": (
        [Start(0, 0, 0.0, ()), Prefill(128), Yield(), Yield(), Cancelled(256, 0, 1), SAVED_300],
        [[], [Progress(128)], [SendCancel(prefilling=True)], [],
         [Release(IDS[:256]), Requeue()], [Commit(SAVED_300)]],
        {"outcome": "preempted", "closed": True},
    ),
    # the worker had sampled when the yield came: it goes on, the slot's reservation is lifted
    "yield lapses": (
        [Start(300, 300, 0.01, ()), Yield(), Token(7, "a"), done(1, 401, 0)],
        [[Touch(K300, 0.01)], [SendCancel(prefilling=True)], [Lapse(), Emit("a")],
         [Finish(), Record(), Release((*IDS, 7))]],
        {"outcome": "ok", "closed": True},
    ),
    # the worker would not stop (its state would not fit the RAM tier): the yield lapses
    "yield not taken": (
        [Start(0, 0, 0.0, ()), Yield(), Kept("its state would not fit the RAM tier"),
         Yield(), Token(7, "a"), done(1, 401, 0)],
        [[], [SendCancel(prefilling=True)], [Lapse("its state would not fit the RAM tier")],
         [], [Emit("a")],
         [Finish(), Record(), Release((*IDS, 7))]],
        {"outcome": "ok", "closed": True},
    ),
    # never after a token, never before the start, and a client that left meanwhile wins
    "no yield after a token": (
        [Start(300, 300, 0.01, ()), Token(7, "a"), Yield(), done(1, 401, 0)],
        [[Touch(K300, 0.01)], [Emit("a")], [], [Finish(), Record(), Release((*IDS, 7))]],
        {"outcome": "ok", "closed": True},
    ),
    "abandoned while yielding": (
        [Start(0, 0, 0.0, ()), Yield(), Abandon(), Cancelled(128, 0, 0)],
        [[], [SendCancel(prefilling=True)], [Count("cancelled"), SendCancel()],
         [Finish(), Release(IDS[:128])]],
        {"outcome": "cancelled", "closed": True},
    ),
}


def test_a_run_yields_only_once_it_started() -> None:
    st = RunState(IDS, PLAN)
    assert st.apply(Yield()) == [] and not st.yielded


@pytest.mark.parametrize("events,effects,final", CASES.values(), ids=CASES.keys())
def test_run_state(events: list[Any], effects: list[list[Any]], final: dict[str, Any]) -> None:
    st = RunState(IDS, PLAN)
    assert [st.apply(ev) for ev in events] == effects
    assert st.outcome == final["outcome"]
    assert st.closed == final["closed"]
    u = st.usage
    expect = {"cached": u.cached_tokens, "source": u.source, "created": u.created_tokens,
              "finish": st.finish_reason, "stop": st.stop}
    assert {k: final[k] for k in final if k in expect} == \
        {k: v for k, v in expect.items() if k in final}


def test_a_run_is_not_closed_until_every_announced_save_is_in() -> None:
    st = RunState(IDS, PLAN)
    st.apply(Start(0, 0, 0.0, ()))
    st.apply(done(0, 400, 2))
    assert st.ended and not st.closed
    st.apply(SAVED_300)
    assert not st.closed
    st.apply(SAVED_400)
    assert st.closed


# --- the driver against a fake worker ------------------------------------------------------

Script = Callable[[web.StreamResponse, asyncio.Event], Any]


class FakeWorker:
    """A real aiohttp app on port 0 that answers /run with a scripted event stream and /cancel
    by setting an event the script may wait on."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.cancelled = asyncio.Event()
        self.jobs: list[Job] = []
        self.cancels: list[dict[str, Any]] = []

    async def run(self, request: web.Request) -> web.StreamResponse:
        self.jobs.append(Job.decode(await request.read()))
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await self.script(resp, self.cancelled)
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        self.cancels.append(await request.json())
        self.cancelled.set()
        return web.json_response({"cancelled": True})


@contextlib.asynccontextmanager
async def fake_worker(script: Script) -> AsyncIterator[tuple[FakeWorker, str]]:
    fake = FakeWorker(script)
    app = web.Application()
    app.router.add_post("/run", fake.run)
    app.router.add_post("/cancel", fake.cancel)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def send(resp: web.StreamResponse, *events: Event) -> None:
    for ev in events:
        await resp.write(encode_event(ev))


class Harness:
    """A real Run over the pool's HTTP worker client, a real DiskCache on LMDB in tmp_path."""

    def __init__(self, tmp_path: Path, url: str) -> None:
        self.metrics = Metrics()
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.index = Index(tmp_path)
        model = tmp_path / "model.gguf"  # the identity hashes a model file: any file will do
        model.write_bytes(b"GGUF fake weights")
        self.cache = DiskCache(self.index, CacheIdentity(str(model), 4096, "f16", "f16", "off",
                                                         "t"),
                               CacheKnobs(), 1 << 30, self.metrics)
        self.pool = Pool(Config())
        self.process = Worker(0, url)
        self.process.session = self.process.new_session()
        self.process.ready = True
        self.worker = self.process.slots[0]  # what a run talks to: the worker's one slot
        self.worker.busy = True
        self.pool.workers.append(self.process)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.deps = RunDeps(self.pool, self.cache, self.metrics, self._spawn, 60.0,
                            self._requeue)

    async def _requeue(self, run: Run) -> tuple[Any, Plan]:
        return await self.pool.acquire(list(IDS), 0, first=True), PLAN

    def _spawn(self, coro: Any) -> None:
        self.tasks.add(asyncio.ensure_future(coro))

    async def run(self, plan: Plan = PLAN) -> Run:
        req = ChatRequest("openai", ({"role": "user", "content": "hi"},))
        prep = Prepared(req, Rendered("", IDS, (400,), ()), Scope("full"), 16, 0.0)
        run = Run(self.deps, prep, self.worker, plan, b"salt" * 4, "")
        await run.open()
        return run

    async def settle(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 30)

    def count(self, outcome: str) -> float:
        return self.metrics.requests.labels("openai", outcome)._value.get()

    async def close(self) -> None:
        await self.pool.close()  # a worker still being rechecked: that stops too
        self.cache.close()
        self.index.close()


@pytest.fixture
def entries(tmp_path: Path) -> Callable[[Harness], dict[int, str]]:
    def read(h: Harness) -> dict[int, str]:
        return {e.n_tokens: e.reason for _, e in h.index.entries()}

    return read


async def test_a_worker_dying_mid_stream_fails_the_request_and_frees_the_worker(
        tmp_path: Path) -> None:
    async def script(resp: web.StreamResponse, cancelled: asyncio.Event) -> None:
        await send(resp, Start(0, 0, 0.0, ()), Prefill(256), Token(7, "x"))
        assert resp.task is not None
        resp.task.cancel()  # the connection drops with no end of stream, as a killed process

    async with fake_worker(script) as (_, url):
        h = Harness(tmp_path / "cache", url)
        run = await h.run()
        got: list[str] = []
        with pytest.raises(WorkerFailed):
            async for piece in run.pieces():
                got.append(piece)
        await h.settle()
        assert got == ["x"]
        # released, but suspect: it may have died, so it takes nothing until it answers again
        assert (h.worker.busy, h.process.ready, h.worker.live_ids) == (False, False, ())
        assert h.count("error") == 1 and h.count("ok") == 0
        await h.close()


async def test_saves_after_done_are_committed_and_a_broken_entry_is_dropped(
        tmp_path: Path, entries: Callable[[Harness], dict[int, str]]) -> None:
    async def script(resp: web.StreamResponse, cancelled: asyncio.Event) -> None:
        await send(resp, Start(100, 100, 0.02, (BROKEN,)), Token(7, "ok"), done(1, 401, 2))
        await asyncio.sleep(0.05)  # the files are written after the worker said Done
        await send(resp, SAVED_300, SAVED_400)

    async with fake_worker(script) as (fake, url):
        h = Harness(tmp_path / "cache", url)
        for key, n, file in ((K300, 300, "kv/a.kv"), (K100, 100, "kv/b.kv")):
            h.index.put(key, Entry(n, file, 10, 0, "cold", 0.0, 0.0, 0, b"", ""))
        run = await h.run()
        assert await run.text() == "ok"
        await h.settle()
        assert entries(h) == {100: "cold", 300: "scoped", 400: "full"}  # 300: the new file
        assert entry_of(h.index, K300) is None  # the broken entry is gone
        hit = entry_of(h.index, K100)
        assert hit is not None and hit.hits == 1
        assert fake.jobs[0].plan == PLAN and fake.jobs[0].ids == IDS
        assert fake.jobs[0].salt == b"salt" * 4
        assert run.usage.cached_tokens == 100 and run.usage.source == "disk"
        assert h.count("ok") == 1
        await h.close()


async def test_tokens_the_worker_sends_together_are_one_piece_and_a_failure_after_them_fails(
        tmp_path: Path) -> None:
    took_first = asyncio.Event()

    async def script(resp: web.StreamResponse, cancelled: asyncio.Event) -> None:
        await send(resp, Start(0, 0, 0.0, ()), Prefill(256), Token(7, "x"))
        await asyncio.wait_for(took_first.wait(), 30)
        # the worker's tokens held for its HTTP thread's beat: one write
        await resp.write(b"".join(encode_event(Token(i, t)) for i, t in enumerate("abc")))
        await resp.write(encode_event(Token(3, "d")) + encode_event(Error("the worker failed")))

    async with fake_worker(script) as (_, url):
        h = Harness(tmp_path / "cache", url)
        run = await h.run()
        got: list[str] = []
        with pytest.raises(WorkerFailed, match="the worker failed"):
            async for piece in run.pieces():
                got.append(piece)
                took_first.set()
        assert got[0] == "x" and "".join(got) == "xabcd" and len(got) < 5
        await h.settle()
        await h.close()


async def test_a_client_that_leaves_cancels_the_run_and_its_snapshot_is_kept(
        tmp_path: Path, entries: Callable[[Harness], dict[int, str]]) -> None:
    async def script(resp: web.StreamResponse, cancelled: asyncio.Event) -> None:
        await send(resp, Start(0, 0, 0.0, ()), Prefill(300))
        await asyncio.wait_for(cancelled.wait(), 30)  # until the proxy sends /cancel
        await send(resp, Cancelled(300, 0, 1), SAVED_300)

    async with fake_worker(script) as (_, url):
        h = Harness(tmp_path / "cache", url)
        run = await h.run()
        await run.aclose()
        await h.settle()
        assert entries(h) == {300: "scoped"}
        assert (h.worker.busy, h.worker.live_ids) == (False, IDS[:300])
        assert h.count("cancelled") == 1
        await h.close()


async def test_a_stream_lost_after_done_loses_only_the_pending_save(
        tmp_path: Path, entries: Callable[[Harness], dict[int, str]]) -> None:
    async def script(resp: web.StreamResponse, cancelled: asyncio.Event) -> None:
        await send(resp, Start(300, 300, 0.01, ()), done(0, 400, 2), SAVED_400)
        assert resp.task is not None
        resp.task.cancel()

    async with fake_worker(script) as (_, url):
        h = Harness(tmp_path / "cache", url)
        run = await h.run()
        assert await run.text() == ""
        await h.settle()
        assert entries(h) == {400: "full"}
        assert (h.worker.busy, h.count("ok")) == (False, 1)
        await h.close()


async def test_a_job_the_worker_refuses_fails_before_any_response(tmp_path: Path) -> None:
    async def script(resp: web.StreamResponse, cancelled: asyncio.Event) -> None:
        await send(resp, Error("ValueError: malformed job"))

    async with fake_worker(script) as (_, url):
        h = Harness(tmp_path / "cache", url)
        with pytest.raises(WorkerFailed, match="malformed job"):
            await h.run()
        assert not h.tasks  # no reader was started: the caller releases the worker
        await h.close()


async def test_a_preempted_run_runs_again_and_its_client_sees_one_answer(
        tmp_path: Path, entries: Callable[[Harness], dict[int, str]]) -> None:
    """A short request took the slot (policies/preempt.py): the worker stops the prefill at a
    batch edge; the run is released with that prefix, queued first, and sent again, which
    starts from the RAM tier; the first run's snapshot is still committed; one answer, one
    request counted, the log line says it."""
    async def script(resp: web.StreamResponse, cancelled: asyncio.Event) -> None:
        if len(fake.jobs) == 1:
            await send(resp, Start(0, 0, 0.0, ()), Prefill(128))
            await asyncio.wait_for(cancelled.wait(), 30)
            await send(resp, Cancelled(256, 0, 1))
            await asyncio.sleep(0.05)  # its file is written after the slot was given up
            await send(resp, SAVED_300)
        else:
            await send(resp, Start(256, 0, 0.01, (), ram=256, tier="ram"), Token(7, "ok"),
                       done(1, 401, 0))

    async with fake_worker(script) as (fake, url):
        h = Harness(tmp_path / "cache", url)
        run = await h.run()
        await h.pool.hold(h.worker, run)
        assert run.left == 400 - 0 and h.worker.holder is run
        assert run.give_way() and not run.give_way(), "once"
        assert await run.text() == "ok"
        await h.settle()
        assert fake.cancels == [{"run_id": fake.jobs[0].run_id, "prefilling": True}]
        assert len(fake.jobs) == 2 and fake.jobs[1].run_id != fake.jobs[0].run_id
        assert entries(h) == {300: "scoped"}
        assert run.preempted and run.usage.source == "ram" and run.usage.cached_tokens == 256
        assert run.left is None, "the second run never gives way"
        assert h.count("ok") == 1 and h.count("cancelled") == 0
        assert h.metrics.preemptions._value.get() == 1
        assert not h.worker.busy and h.worker.live_ids == (*IDS, 7)
        await h.close()


async def test_a_preempted_run_whose_client_leaves_while_it_waits_sends_nothing_more(
        tmp_path: Path) -> None:
    """The client goes while the preempted run waits for its next slot: the slot it gets is
    given back as it was, no second job goes to the worker, the request counts as cancelled
    once."""
    slot_free = asyncio.Event()

    async def script(resp: web.StreamResponse, cancelled: asyncio.Event) -> None:
        await send(resp, Start(0, 0, 0.0, ()), Prefill(128))
        await asyncio.wait_for(cancelled.wait(), 30)
        await send(resp, Cancelled(256, 0, 0))

    async with fake_worker(script) as (fake, url):
        h = Harness(tmp_path / "cache", url)

        async def requeue(run: Run) -> tuple[Any, Plan]:
            await slot_free.wait()  # every slot busy meanwhile
            return await h.pool.acquire(list(IDS), 0, first=True), PLAN

        h.deps = RunDeps(h.pool, h.cache, h.metrics, h._spawn, 60.0, requeue)
        run = await h.run()
        assert run.give_way()
        for _ in range(200):
            if run.preempted:
                break
            await asyncio.sleep(0.01)
        await run.aclose()
        slot_free.set()
        assert await run.text() == ""
        await h.settle()
        assert len(fake.jobs) == 1 and not h.worker.busy
        assert h.worker.live_ids == IDS[:256], "the first run's prefix, as released"
        assert h.count("cancelled") == 1 and h.count("ok") == 0
        await h.close()
