"""Steps 5 and 6 of a request: one run on one worker, and what its events commit.

`Run` drives one run through the seams below: it sends the job, feeds the worker's events and
its own to the pure state machine (`proxy.run_state.RunState`: the rules), and performs the
effects it returns. A run preempted while it prefills (policies/preempt.py) runs again, once,
on the slot the proxy gives it first (`RunDeps.requeue`): its client's stream goes on as if
nothing happened, the first run's snapshots are still committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from backend.protocol import (
    Done,
    Event,
    Job,
    Saved,
    Token,
)
from policies.decide import Plan
from policies.scope import format_scope
from proxy.errors import WorkerFailed
from proxy.metrics import Metrics
from proxy.prompt import Prepared
from proxy.run_state import (
    Abandon,
    Commit,
    Count,
    Drop,
    Effect,
    Emit,
    Fail,
    Finish,
    Lapse,
    LostSaves,
    Progress,
    Record,
    Release,
    Requeue,
    RunEvent,
    RunState,
    SaveFailure,
    SendCancel,
    Shutdown,
    StreamLost,
    Touch,
    Usage,
    Yield,
)
from proxy.speculation import log_fields

log = logging.getLogger("prefixgate")
_NONE: Any = object()  # `pieces`: no item taken yet

PROGRESS_LOG_S = 30.0  # a prefill running longer logs its progress this often


# --- the seams the driver works through ----------------------------------------------------


class EventStream(Protocol):
    async def next(self) -> Event:
        """The next event; raises WorkerFailed when the stream fails or ends early."""

    def close(self) -> None: ...


class WorkerClient(Protocol):
    """What a run needs of a worker's slot: `proxy.worker_link.Slot` over HTTP, or a test's fake."""

    @property
    def worker_id(self) -> int: ...

    @property
    def label(self) -> str: ...  # for log lines: "0", or "0.1" (worker 0, slot 1)

    def run(self, job: Job, timeout_s: float
            ) -> contextlib.AbstractAsyncContextManager[EventStream]: ...

    async def cancel(self, run_id: str, prefilling: bool = False) -> bool: ...


class Releaser(Protocol):
    async def release(self, w: Any, live_ids: Sequence[int], tenant: str = "",
                      suspect: bool = False, floor: int = 0,
                      costs: dict[str, Any] | None = None) -> None: ...

    async def lapse(self, w: Any) -> None: ...  # a yield came too late: lift its reservation

    async def give_back(self, w: Any) -> None: ...  # acquired, never used: as it was


class Committer(Protocol):
    """What a run commits to (proxy.cache.DiskCache); None when there is no disk cache."""

    async def write(self, fn: Callable[..., Any], *args: object) -> Any: ...

    def commit(self, saved: Saved, tenant: str, ids: Sequence[int]) -> None: ...

    def touch(self, key: bytes, now_s: float) -> None: ...

    def drop(self, key: bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class RunDeps:
    """What a run needs from the proxy, and nothing more."""

    pool: Releaser
    cache: Committer | None
    metrics: Metrics
    spawn: Callable[[Any], None]  # run a background task the proxy awaits at shutdown
    timeout_s: float  # a worker run longer than this fails
    # a preempted run's next slot and plan, first in the queue (proxy.gateway.Gateway.requeue)
    requeue: Callable[[Run], Awaitable[tuple[WorkerClient, Plan]]] | None = None


# --- the driver --------------------------------------------------------------------------


class Run:
    """One request on one worker. `open()`, then iterate `pieces()`; `usage`, `finish_reason`
    and `stop` are final after it ends. `aclose()` abandons a run the client left.

    One reader task owns the worker's event stream from `Start` to its end and performs the
    state machine's effects; the consumer reads text from a queue."""

    def __init__(self, deps: RunDeps, prep: Prepared, worker: WorkerClient, plan: Plan,
                 salt: bytes, tenant: str) -> None:
        self.deps, self.prep, self.worker, self.plan = deps, prep, worker, plan
        self.salt, self.tenant = salt, tenant
        self.run_id = uuid.uuid4().hex
        self.state = RunState(prep.rendered.ids, plan)
        self.ttft_s: float | None = None
        self.headers: Mapping[str, str] = {}  # the client's request headers (its session id)
        self._cm: contextlib.AbstractAsyncContextManager[EventStream] | None = None
        self._stream: EventStream | None = None
        self._queue: asyncio.Queue[str | BaseException | None] = asyncio.Queue()
        self._progress_logged_s = prep.arrived_s
        self.preempted = False  # it gave its slot to a short request and ran again
        self._gone = False  # the client went away

    @property
    def usage(self) -> Usage:
        return self.state.usage

    @property
    def finish_reason(self) -> str:
        return self.state.finish_reason

    @property
    def timings(self) -> dict[str, float]:
        return self.state.timings

    @property
    def done(self) -> bool:
        return self.state.ended

    def job(self) -> Job:
        p = self.prep
        return Job(self.run_id, p.rendered.ids, self.salt, self.tenant, self.plan,
                   p.req.sampling, p.max_tokens, p.req.stop, p.grammar,
                   waited_s=max(time.perf_counter() - p.arrived_s, 0.0), stream=p.req.stream)

    @property
    def left(self) -> int | None:
        """Prompt tokens it has still to prefill while it may give its slot to a short request
        (policies/preempt.py); None when it may not."""
        st = self.state  # a plan that reuses nothing would lose its prefill: never
        return len(st.ids) - st.live_n if st.may_yield and self.plan.keep_max > 0 else None

    @property
    def generating(self) -> tuple[int, int, int] | None:
        """(tokens generated, the most it may still generate, tokens its state holds) while
        it generates, where a short request may have it parked (policies/preempt.py rule 4);
        None before its first token and once it ended."""
        st = self.state
        if not st.tokens or st.ended or st.abandoned:
            return None
        n = len(st.gen_ids)
        return n, self.prep.max_tokens - n, len(st.ids) + n

    @property
    def progress(self) -> tuple[int, int]:
        """(prompt tokens, of them in the worker's KV now): `/slots` shows a long prefill."""
        return len(self.state.ids), self.state.live_n

    def give_way(self) -> bool:
        """A short request takes this slot: stop if still prefilling (False: it may not)."""
        effects = self.state.apply(Yield())
        if effects:
            self.deps.spawn(self._perform_all(effects))
        return bool(effects)

    async def _perform_all(self, effects: list[Effect]) -> None:
        for fx in effects:
            await self._perform(fx)

    async def open(self) -> None:
        """Send the job and wait for its `Start`: any failure is known before a response is
        prepared. On failure the caller releases the worker."""
        await self.open_stream()
        self.deps.spawn(self._read())

    async def open_stream(self) -> None:
        self._cm = self.worker.run(self.job(), self.deps.timeout_s)
        try:
            self._stream = await self._cm.__aenter__()
            ev = await self._next()
            for fx in self.state.apply(ev):
                if isinstance(fx, Fail):
                    raise WorkerFailed(f"worker {self.worker.label}: {fx.message}")
                await self._perform(fx)
        except BaseException:
            await self._close_stream()
            raise

    async def _next(self, stream: EventStream | None = None) -> RunEvent:
        stream = stream or self._stream
        assert stream is not None
        try:
            return await stream.next()
        except WorkerFailed as e:
            return StreamLost(e.message)

    async def _read(self) -> None:
        try:
            while self._stream is not None and not self.state.closed:
                ev = await self._next()
                if self.ttft_s is None and isinstance(ev, Token | Done):
                    self.ttft_s = time.perf_counter() - self.prep.arrived_s
                for fx in self.state.apply(ev):
                    await self._perform(fx)
        except asyncio.CancelledError:  # shutdown: the worker is going away too
            for fx in self.state.apply(Shutdown()):
                await self._perform(fx)
            raise
        except Exception as e:  # a bug here must not leave the worker taken for good
            log.exception("run on worker %s failed", self.worker.label)
            for fx in self.state.apply(StreamLost(f"{type(e).__name__}: {e}")):
                with contextlib.suppress(Exception):
                    await self._perform(fx)
        finally:
            await self._close_stream()

    # --- effects ---------------------------------------------------------------------------

    async def _perform(self, fx: Effect) -> None:
        await _PERFORM[type(fx)](self, fx)

    async def _emit(self, fx: Emit) -> None:
        self._queue.put_nowait(fx.text)

    async def _finish(self, fx: Finish) -> None:
        self._queue.put_nowait(None)

    async def _fail(self, fx: Fail) -> None:
        self._queue.put_nowait(WorkerFailed(f"worker {self.worker.label}: {fx.message}"))

    async def _commit(self, fx: Commit) -> None:
        m, s = self.deps.metrics, fx.saved
        try:
            assert self.deps.cache is not None, "a save without a disk cache"
            await self.deps.cache.write(self.deps.cache.commit, s, self.tenant,
                                        self.prep.rendered.ids)
        except Exception as e:  # a cache fault never fails the request
            m.faults.labels("index").inc()
            log.warning("cache entry at %d tokens not recorded: %s: %s", s.n_tokens,
                        type(e).__name__, e)
            return
        m.saves.labels(s.reason, "ok").inc()
        m.save_seconds.observe(s.save_s)

    async def _save_failure(self, fx: SaveFailure) -> None:
        f = fx.failed
        self.deps.metrics.saves.labels(f.reason, "failed").inc()
        self.deps.metrics.faults.labels(f.fault).inc()
        log.warning("cache save failed (%s at %d tokens): %s", f.reason, f.n_tokens, f.message)

    async def _drop(self, fx: Drop) -> None:
        self.deps.metrics.faults.labels(fx.fault.reason).inc()
        log.warning("cache fault (%s)%s: %s", fx.fault.reason,
                    ", entry dropped" if fx.key is not None else "", fx.fault.message)
        if fx.key is not None and self.deps.cache is not None:
            try:
                await self.deps.cache.write(self.deps.cache.drop, fx.key)
            except Exception as e:
                log.warning("broken entry not dropped: %s: %s", type(e).__name__, e)

    async def _touch(self, fx: Touch) -> None:
        self.deps.metrics.restore_seconds.observe(fx.restore_s)
        if self.deps.cache is not None:
            try:
                await self.deps.cache.write(self.deps.cache.touch, fx.key, time.time())
            except Exception as e:
                log.warning("hit not recorded: %s: %s", type(e).__name__, e)

    async def _progress(self, fx: Progress) -> None:
        """A long prefill logs its progress every PROGRESS_LOG_S."""
        now = time.perf_counter()
        if now - self._progress_logged_s < PROGRESS_LOG_S:
            return
        self._progress_logged_s = now
        n, cached = self.usage.prompt_tokens, self.usage.cached_tokens
        rate = (fx.n_live - cached) / max(now - self.prep.arrived_s, 1e-9)
        log.info("%s prefilling %d/%d tokens (%d cached, %.0f tokens/s) worker=%s",
                 self.prep.req.api, fx.n_live, n, cached, rate, self.worker.label)

    async def _record(self, fx: Record) -> None:
        u, m, api, plan = self.usage, self.deps.metrics, self.prep.req.api, self.plan
        m.requests.labels(api, "ok").inc()
        m.prompt_tokens.inc(u.prompt_tokens)
        if u.cached_tokens:
            m.cached_tokens.labels(u.source).inc(u.cached_tokens)
        m.prefilled_tokens.inc(u.prompt_tokens - u.cached_tokens)
        m.generated_tokens.inc(u.completion_tokens)
        if plan.lookup != "off":
            m.lookups.labels(plan.lookup).inc()
        if plan.restore_skipped:
            m.restores_skipped.inc()
        m.prefill_seconds.observe(self.timings.get("prefill_s", 0.0))
        m.count_drafts(self.state.draft)
        if self.ttft_s is not None:
            m.ttft_seconds.labels(api, "cold" if u.source == "none" else u.source).observe(
                self.ttft_s)
        saves = ",".join(f"{s.reason}@{s.n_tokens}" for s in plan.saves) or "-"
        self._line(
            "%s prompt=%d cached=%d source=%s scope=%s boundary=%s lookup=%s saves=%s "
            "prefill_s=%.3f decode_s=%.3f ttft_s=%.3f gen=%d%s finish=%s worker=%s%s",
            api, u.prompt_tokens, u.cached_tokens, u.source, format_scope(self.prep.scope),
            plan.boundary if plan.boundary is not None else "-", plan.lookup, saves,
            self.timings.get("prefill_s", 0.0), self.timings.get("decode_s", 0.0),
            self.ttft_s or 0.0, u.completion_tokens, log_fields(self.state.draft),
            self.finish_reason,
            self.worker.label,
            (f" anchor_skipped=\"{plan.anchor_skipped}\"" if plan.anchor_skipped else "")
            + (f" restore_skipped=\"{plan.restore_skipped}\"" if plan.restore_skipped else "")
            + (" preempted=1" if self.preempted else ""))

    def _line(self, fmt: str, *args: object) -> None:
        """The request's one log line, kept among the recent ones too (the status page)."""
        line = fmt % args
        log.info("%s", line)
        self.deps.metrics.recent_lines.append((time.time(), line))

    async def _count(self, fx: Count) -> None:
        self.deps.metrics.requests.labels(self.prep.req.api, fx.outcome).inc()

    async def _release(self, fx: Release) -> None:
        st = self.state
        if st.outcome not in ("ok", "preempted"):  # preempted: the pool said it
            u = self.usage
            self._line("%s prompt=%d cached=%d source=%s %s live=%d worker=%s",
                       self.prep.req.api, u.prompt_tokens, u.cached_tokens, u.source,
                       st.outcome, len(fx.live_ids), self.worker.label)
        await self.deps.pool.release(self.worker, fx.live_ids, self.tenant, fx.suspect,
                                     fx.floor, fx.costs)

    async def _send_cancel(self, fx: SendCancel) -> None:
        """The worker stops at its next prefill batch or token and keeps what it prefilled; a
        worker that does not take the cancel has its stream closed, which cancels the run too
        (its snapshots are then lost). A preemption's cancel not taken: the run goes on."""
        if not await self.worker.cancel(self.run_id, fx.prefilling) and not fx.prefilling \
                and not self.state.ended:
            await self._close_stream()  # the reader sees the stream end and releases

    async def _lapse(self, fx: Lapse) -> None:
        if fx.reason:
            log.info("preempt: the run on slot %s keeps it: %s", self.worker.label, fx.reason)
        await self.deps.pool.lapse(self.worker)

    async def _requeue(self, fx: Requeue) -> None:
        """Preempted: the first run's stream drains its snapshots on its own; the request runs
        again, first in the queue, from what the first run left (its worker's RAM tier)."""
        old, cm, stream = self.state, self._cm, self._stream
        self._cm = self._stream = None
        self.deps.spawn(self._drain(old, cm, stream))
        self.deps.metrics.preemptions.inc()
        self.preempted = True
        if self._gone:  # it left as the first run was released (its Abandon counted nothing)
            await self._count(Count("cancelled"))
            self._queue.put_nowait(None)
            return
        assert self.deps.requeue is not None, "a run gave way with nowhere to run again"
        try:
            worker, plan = await self.deps.requeue(self)
        except Exception as e:  # no worker is reachable any more, or a bug (logged)
            if not isinstance(e, WorkerFailed):
                log.exception("a preempted run could not be queued again")
            self._queue.put_nowait(e if isinstance(e, WorkerFailed) else WorkerFailed(
                f"the request could not run again after giving way: {type(e).__name__}"))
            return
        if self._gone:  # the client left while it waited: the slot goes back untouched
            await self.deps.pool.give_back(worker)
            await self._count(Count("cancelled"))
            self._queue.put_nowait(None)
            return
        self.worker, self.plan, self.run_id = worker, plan, uuid.uuid4().hex
        self.state = RunState(old.ids, plan, yielded=True)
        try:
            await self.open_stream()
        except WorkerFailed as e:
            await self.deps.pool.release(worker, [], self.tenant)
            self._stream = None
            self._queue.put_nowait(e)
            return
        if self._gone:
            await self._perform_all(self.state.apply(Abandon()))

    async def _drain(self, state: RunState, cm: Any, stream: EventStream | None) -> None:
        """A preempted run's stream after its end: the snapshots it had begun, committed."""
        try:
            while stream is not None and not state.closed:
                for fx in state.apply(await self._next(stream)):
                    if isinstance(fx, Commit | SaveFailure | LostSaves | Drop):
                        await self._perform(fx)
        finally:
            await _close(cm, stream)

    async def _lost_saves(self, fx: LostSaves) -> None:
        log.warning("saves of this request lost: %s", fx.message)

    async def _close_stream(self) -> None:
        cm, self._cm = self._cm, None
        await _close(cm, self._stream)

    # --- the consumer side -----------------------------------------------------------------

    async def pieces(self) -> AsyncIterator[str]:
        """Generated text; ends at `Done`. Saves are committed in the background after. The
        pieces that came together (the worker sends tokens a few at a time) are one."""
        ended, item = False, _NONE
        try:
            while True:
                if item is _NONE:
                    item = await self._queue.get()
                if item is None:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                text, item = [item], _NONE
                while not self._queue.empty():
                    came = self._queue.get_nowait()
                    if not isinstance(came, str):
                        item = came
                        break
                    text.append(came)
                yield "".join(text)
        finally:
            if not ended:  # the consumer stopped early: the client went away
                await self.aclose()

    async def text(self) -> str:
        return "".join([p async for p in self.pieces()])

    async def aclose(self) -> None:
        """Abandon the run (the client went away); its snapshots are still committed."""
        self._gone = True
        await self._perform_all(self.state.apply(Abandon()))


async def _close(cm: Any, stream: EventStream | None) -> None:
    """A worker stream's end, whatever state it failed in."""
    if cm is not None:
        if stream is not None:
            stream.close()
        with contextlib.suppress(Exception):  # closing a failed stream
            await cm.__aexit__(None, None, None)


_PERFORM: dict[type, Callable[[Run, Any], Any]] = {
    Emit: Run._emit, Finish: Run._finish, Fail: Run._fail, Commit: Run._commit,
    SaveFailure: Run._save_failure, Drop: Run._drop, Touch: Run._touch,
    Progress: Run._progress, Record: Run._record, Count: Run._count, Release: Run._release,
    SendCancel: Run._send_cancel, LostSaves: Run._lost_saves, Requeue: Run._requeue,
    Lapse: Run._lapse,
}
