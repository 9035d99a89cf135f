"""The path of one request, after parsing: normalize, render and tokenize, decide, execute, commit.

    prepare(req)  -> Prepared      normalize volatile bytes, render the chat template, tokenize,
                                   reject prompts that do not fit the context
    start(prep)   -> Run           decide (scope, disk lookup, worker, save points), send the plan
                                   to the worker and wait for its `start` event, so that any
                                   failure is known before an HTTP response is prepared
    Run.pieces()                   the generated text, piece by piece
    (background)  commit           the worker's `saved` events become LMDB entries, then eviction

Cache faults never fail a request: a bad entry is dropped, counted and logged once, and the
worker tries the next-shorter entry (up to RESTORE_FALLBACKS more), then prefills.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jinja2
import xxhash

from backend import keys
from backend.index import Entry, Index
from policies.plan import (
    CacheKnobs,
    MessageStart,
    SavePlan,
    anchor_position,
    candidate_positions,
    choose_scope_boundary,
    extends_recent,
    plan_saves,
    reuse_limit,
)
from policies.prefix import common_prefix_len
from policies.ring import Ring
from policies.scope import Scope, format_scope, parse_scope
from proxy.chat import ChatRequest
from proxy.config import Config
from proxy.errors import BadRequest, ContextOverflow, WorkerFailed
from proxy.metrics import Metrics
from proxy.template import CannotContinue, ChatTemplate, Rendered, render_prompt
from proxy.tokenizer import Tokenizer
from proxy.tools import apply as tool_prompt
from proxy.workers import Pool, Worker

log = logging.getLogger("prefixgate")

RING_CAPACITY = 256  # recent prompts remembered (all tenants together)
PROGRESS_LOG_S = 30.0  # a prefill running longer logs its progress this often
RESTORE_FALLBACKS = 2  # shorter entries the worker may try after a broken one
SHUTDOWN_COMMIT_WAIT_S = 30.0  # how long a stopping proxy waits for snapshots being written


def tenant_id(api_key: str) -> str:
    """What identifies a tenant in keys, the ring and the index: a hash, never the key itself."""
    return xxhash.xxh3_128_hexdigest(b"prefixgate-tenant\0" + api_key.encode())


@dataclass(frozen=True, slots=True)
class Prepared:
    req: ChatRequest
    rendered: Rendered
    scope: Scope
    max_tokens: int
    arrived_s: float  # perf_counter at arrival, for time to first token
    grammar: str | None = None  # GBNF constraining the output (forced tool calls)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # not prefilled: live KV kept or restored from disk
    source: str = "none"  # "live" | "disk" | "none"
    created_tokens: int = 0  # prefilled tokens covered by a new snapshot
    completion_tokens: int = 0

    @property
    def input_tokens(self) -> int:  # Anthropic: prefilled and not newly snapshotted
        return self.prompt_tokens - self.cached_tokens - self.created_tokens


class Normalizer:
    """Strips volatile bytes (per-request ids, billing lines) from system and user text."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.patterns = patterns
        self._res = [re.compile(p) for p in patterns]

    def text(self, s: str) -> str:
        for r in self._res:
            s = r.sub("", s)
        return s

    def messages(self, messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            c = m.get("content")
            if self._res and m.get("role") in ("system", "developer", "user") and isinstance(c,
                                                                                           str):
                m = {**m, "content": self.text(c)}
            out.append(m)
        return out


@dataclass(slots=True)
class Decision:
    disk_n: int = 0
    disk_entry: Entry | None = None
    disk_key: keys.CacheKey | None = None
    # the next-shorter stored entries, tried in order when a longer one turns out broken
    fallbacks: list[tuple[int, keys.CacheKey, Entry]] = field(default_factory=list)
    live_n: int = 0
    boundary: int | None = None
    plan: SavePlan | None = None
    saves: list[dict[str, Any]] = field(default_factory=list)
    lookup: str = "off"  # hit | partial | miss | off
    keyed: dict[int, keys.CacheKey] = field(default_factory=dict)  # candidate position -> key
    keep_max: int = 0  # reuse at most this many tokens (live or restored)

    def restorable(self) -> list[tuple[int, keys.CacheKey, Entry]]:
        """The disk hit and its fallbacks, longest first."""
        best = [] if self.disk_entry is None or self.disk_key is None else [
            (self.disk_n, self.disk_key, self.disk_entry)]
        return best + self.fallbacks


class Gateway:
    def __init__(self, cfg: Config, template: ChatTemplate, tokenizer: Tokenizer, pool: Pool,
                 index: Index | None, metrics: Metrics, model_salt: dict[str, Any]) -> None:
        self.cfg = cfg
        self.template = template
        self.tok = tokenizer
        self.pool = pool
        self.index = index
        self.metrics = metrics
        self.ring = Ring(RING_CAPACITY)
        if index is not None:  # the ring survives restarts, so `auto` does too
            for tenant, ids in index.ring_load():
                self.ring.push(tenant, ids)
        self.normalizer = Normalizer(cfg.volatile_patterns)
        self.knobs = CacheKnobs(cfg.kv_cache_min_tokens, cfg.kv_cache_cold_max_tokens,
                                cfg.kv_cache_continued_interval_tokens)
        self.default_scope = parse_scope(cfg.disk_prefix_cache)
        self._model_salt = model_salt
        self._salts: dict[str, bytes] = {}
        self.fingerprint = keys.fingerprint(self.salt(""))
        self._background: set[asyncio.Task[None]] = set()
        self.n_ctx = cfg.n_ctx

    def salt(self, tenant: str) -> bytes:
        if tenant not in self._salts:
            self._salts[tenant] = keys.make_salt(**self._model_salt, tenant=tenant)
        return self._salts[tenant]

    # --- 1-3: normalize, render, tokenize ------------------------------------------------

    def prepare(self, req: ChatRequest) -> Prepared:
        t0 = time.perf_counter()
        try:
            scope = parse_scope(req.scope or format_scope(self.default_scope), req.window)
        except ValueError as e:
            raise BadRequest(str(e), param="prefix_cache") from None
        grammar = None
        if req.prompt is not None:
            ids = tuple(self.tok.encode(self.normalizer.text(req.prompt)))
            if self.tok.add_bos and self.tok.bos_id is not None:
                ids = (self.tok.bos_id, *ids)
            rendered = Rendered(req.prompt, ids, (len(ids),), ())
        else:
            messages, tools, grammar = tool_prompt(self.template.supports_tools,
                                                   self.normalizer.messages(req.messages),
                                                   req.tools, req.tool_choice)
            try:
                rendered = render_prompt(self.template, self.tok, messages, tools,
                                         req.continue_final)
            except jinja2.TemplateError as e:  # e.g. a template that wants alternating roles
                raise BadRequest(f"the model's chat template rejected these messages: {e}",
                                 param="messages") from None
            except CannotContinue as e:
                raise BadRequest(str(e), param="messages") from None
        n = len(rendered.ids)
        if n == 0:
            raise BadRequest("the prompt renders to zero tokens; send some text",
                             param="messages")
        if n >= self.n_ctx:
            raise ContextOverflow(n, self.n_ctx)
        room = self.n_ctx - n
        max_tokens = min(req.max_tokens, room) if req.max_tokens else room
        return Prepared(req, rendered, scope, max_tokens, t0, grammar)

    # --- 4: decide -------------------------------------------------------------------------

    def _lookup(self, ids: tuple[int, ...], boundaries: tuple[int, ...], scope: Scope,
                tenant: str) -> tuple[dict[int, keys.CacheKey], Decision]:
        d = Decision()
        if self.index is None or scope.kind == "off":
            return {}, d
        positions = candidate_positions(len(ids), boundaries, scope, self.knobs)
        keyed = keys.prefix_keys(self.salt(tenant), ids, positions)
        d.keyed = keyed
        hits = self.index.hits(keyed, 1 + RESTORE_FALLBACKS)
        if hits:
            (d.disk_n, d.disk_key, d.disk_entry), d.fallbacks = hits[0], hits[1:]
        return keyed, d

    def _plan(self, prep: Prepared, keyed: dict[int, keys.CacheKey], d: Decision,
              tenant: str) -> None:
        ids, scope = prep.rendered.ids, prep.scope
        n = len(ids)
        d.keep_max = max(n - 2, 0)  # the worker always evaluates the last two prompt tokens
        if self.index is None or scope.kind == "off":
            return
        recent = self.ring.recent(tenant, scope.window) if scope.kind == "auto" else []
        d.boundary = choose_scope_boundary(ids, prep.rendered.boundaries, scope, recent,
                                           self.knobs)
        starts = [MessageStart(p, r) for p, r in prep.rendered.message_starts]
        stored = self.index.stored(keyed)
        d.keep_max = min(reuse_limit(max(d.live_n, d.disk_n), d.boundary, stored), d.keep_max)
        cached_n = min(max(d.live_n, d.disk_n), d.keep_max)
        d.plan = plan_saves(n, cached_n, scope, d.boundary, anchor_position(starts), stored,
                            self.knobs, growing=extends_recent(ids, recent))
        d.saves = [{"n_tokens": s.n_tokens, "key": keyed[s.n_tokens].hex(), "reason": s.reason}
                   for s in d.plan.saves if s.n_tokens in keyed]
        # hit: the entry reaches the scope boundary (or, with none, the last message start);
        # partial: a shorter entry, e.g. only the anchor
        target = d.boundary or max((p for p, _ in prep.rendered.message_starts), default=n)
        d.lookup = "miss" if d.disk_n == 0 else "hit" if d.disk_n >= target else "partial"
        if self.cfg.debug_trace and d.disk_n == 0:
            self._trace_miss(ids, tenant)

    def _trace_miss(self, ids: tuple[int, ...], tenant: str) -> None:
        best = max(self.ring.recent(tenant, 256), key=lambda r: common_prefix_len(ids, r),
                   default=None)
        if best is None:
            log.debug("trace: miss, no earlier prompt to compare with")
            return
        i = common_prefix_len(ids, best)
        lo, hi = max(0, i - 4), i + 5
        log.info("trace: miss; first mismatch at token %d: prompt %s %r vs best earlier %s %r",
                 i, list(ids[lo:hi]), self.tok.decode(ids[lo:hi]), list(best[lo:hi]),
                 self.tok.decode(best[lo:hi]))

    # --- 5: execute ------------------------------------------------------------------------

    async def start(self, prep: Prepared) -> Run:
        ids = prep.rendered.ids
        tenant = tenant_id(prep.req.tenant) if self.cfg.tenant_isolation else ""
        keyed, d = self._lookup(ids, prep.rendered.boundaries, prep.scope, tenant)
        self.metrics.queue_depth.set(self.pool.queue_depth + 1)
        worker = await self.pool.acquire(list(ids), d.disk_n, tenant)
        self.metrics.queue_depth.set(self.pool.queue_depth)
        d.live_n = worker.live_prefix(ids, tenant)
        try:
            self._plan(prep, keyed, d, tenant)
            if prep.scope.kind != "off":
                self.ring.push(tenant, ids)
                if self.index is not None:
                    self.spawn(asyncio.to_thread(self.index.ring_push, tenant, ids,
                                                 RING_CAPACITY))
            plan = {
                "ids": list(ids),
                "restore": [{"file": e.file, "n_tokens": n} for n, _, e in d.restorable()
                            if n > d.live_n],
                "saves": d.saves,
                "sampling": prep.req.sampling,
                "max_tokens": prep.max_tokens,
                "stop": list(prep.req.stop),
                "grammar": prep.grammar,
                "live_ok": worker.live_tenant == tenant,
                "keep_max": d.keep_max,
            }
            run = Run(self, prep, worker, d, tenant)
            await run.open(plan)
            return run
        except BaseException:
            await self.pool.release(worker, [], tenant)
            raise

    # --- 6: commit -------------------------------------------------------------------------

    def commit_save(self, ev: dict[str, Any], tenant: str,
                    keyed: dict[int, keys.CacheKey]) -> None:
        reason = ev["reason"]
        if ev["event"] != "saved":
            self.metrics.saves.labels(reason, "failed").inc()
            self.metrics.faults.labels(ev.get("fault", "io")).inc()
            log.warning("cache save failed (%s at %d tokens): %s", reason, ev["n_tokens"],
                        ev.get("message"))
            return
        assert self.index is not None
        now = time.time()
        key = keys.CacheKey(bytes.fromhex(ev["key"]))
        n = ev["n_tokens"]
        # the longest stored entry this one extends: eviction weights contained entries down
        below = [p for p in keyed if p < n and self.index.get(keyed[p]) is not None]
        prefix_of = keyed[max(below)] if below else b""
        self.index.put(key, Entry(
            n_tokens=ev["n_tokens"], file=ev["file"], size_bytes=ev["size_bytes"],
            checksum=ev["checksum"], reason=reason, created_s=now, last_used_s=now, hits=0,
            fingerprint=self.fingerprint, tenant=tenant, prefix_of=prefix_of))
        self.metrics.saves.labels(reason, "ok").inc()
        self.metrics.save_seconds.observe(ev["save_s"])
        self.evict(protect=key)

    def evict(self, protect: keys.CacheKey | None = None) -> None:
        assert self.index is not None
        from policies.eviction import EntryView, evict_until

        entries = self.index.entries()
        total = sum(e.size_bytes for _, e in entries)
        if total > self.cfg.cache_max_bytes:
            contained = {e.prefix_of for _, e in entries if e.prefix_of}
            views = [EntryView(k, e.n_tokens, e.size_bytes, e.reason, e.created_s,
                               e.last_used_s, e.hits, k in contained) for k, e in entries]
            for k in evict_until(views, self.cfg.cache_max_bytes, time.time(),
                                 protect=[protect] if protect else []):
                gone = self.index.delete(keys.CacheKey(k))
                if gone is not None:
                    total -= gone.size_bytes
                    self.metrics.evictions.inc()
                    self.metrics.evicted_bytes.inc(gone.size_bytes)
        self.metrics.cache_bytes.set(total)
        self.metrics.cache_entries.set(len(self.index))

    def drop_faulty(self, d: Decision, fault: dict[str, Any]) -> None:
        self.metrics.faults.labels(fault["reason"]).inc()
        log.warning("cache fault (%s), entry dropped: %s", fault["reason"], fault["message"])
        for _, key, entry in d.restorable():
            if self.index is not None and entry.file == fault.get("file"):
                self.index.delete(key)

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """At shutdown, pending cache commits (snapshots a worker is still writing after the
        response went out) get up to SHUTDOWN_COMMIT_WAIT_S to land; a file whose entry is not
        committed would be an orphan, deleted at the next start."""
        pending = list(self._background)
        if pending:
            log.info("shutdown: waiting up to %.0f s for %d pending cache commits",
                     SHUTDOWN_COMMIT_WAIT_S, len(pending))
            _, late = await asyncio.wait(pending, timeout=SHUTDOWN_COMMIT_WAIT_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)


class Run:
    """One request on one worker. Iterate `pieces()`; `usage` and `finish_reason` are final
    after it ends. `aclose()` cancels a run the client abandoned.

    One reader task owns the worker's event stream from `start` to its end: tokens go to
    `pieces()` through a queue; `saved` events are committed as they come; at `done` (or
    `cancelled`, or a failure) the worker is released with what its KV holds, and the reader
    stays on until the snapshots still being written are committed. A cancel is a message to
    the worker (`/cancel`), not a closed stream, so a cancelled run's snapshots are kept too.
    """

    def __init__(self, gw: Gateway, prep: Prepared, worker: Worker, d: Decision,
                 tenant: str) -> None:
        self.gw, self.prep, self.worker, self.d, self.tenant = gw, prep, worker, d, tenant
        n = len(prep.rendered.ids)
        self.run_id = uuid.uuid4().hex
        self.usage = Usage(prompt_tokens=n)
        self.finish_reason = "length"
        self.gen_ids: list[int] = []
        self.ttft_s: float | None = None
        self.timings: dict[str, float] = {}
        self._cm: Any = None
        self._resp: aiohttp.ClientResponse | None = None
        self._done = False  # the run ended (done, cancelled or failed): nothing to cancel
        self._abandoned = False  # aclose() was called: tokens are no longer wanted
        self._saves_seen = 0
        self._queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()
        self.stop_sequence_hit = False
        self.live_n = 0  # prompt tokens the worker's KV holds so far (kept, restored, prefilled)
        self._progress_logged_s = prep.arrived_s

    async def open(self, plan: dict[str, Any]) -> None:
        plan["run_id"] = self.run_id
        self._cm = self.worker.run(plan, self.gw.cfg.request_timeout_s)
        self._resp = await self._cm.__aenter__()
        try:
            ev = await self._next()
            if ev.get("event") == "error":
                raise WorkerFailed(f"worker {self.worker.worker_id}: {ev.get('message')}")
        except BaseException:
            await self._close_stream()
            raise
        self._on_start(ev)
        self.gw.spawn(self._read())

    async def _next(self) -> dict[str, Any]:
        assert self._resp is not None
        try:
            line = await self._resp.content.readline()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise WorkerFailed(f"worker {self.worker.worker_id} failed mid-request: {e}") from e
        if not line:
            raise WorkerFailed(f"worker {self.worker.worker_id} ended the stream early")
        return dict(json.loads(line))

    def _on_start(self, ev: dict[str, Any]) -> None:
        gw, d, u = self.gw, self.d, self.usage
        for fault in ev.get("faults") or ():
            gw.drop_faulty(d, fault)
        u.cached_tokens = self.live_n = int(ev["keep"])
        if ev["restored"]:
            u.source = "disk"
            gw.metrics.restore_seconds.observe(ev["restore_s"])
            for n, key, _ in d.restorable():
                if n == ev["restored"] and gw.index is not None:
                    gw.index.touch(key, time.time())
        elif u.cached_tokens:
            u.source = "live"
        saves = [s["n_tokens"] for s in d.saves if s["n_tokens"] >= u.cached_tokens]
        u.created_tokens = max(saves, default=u.cached_tokens) - u.cached_tokens
        self.timings["restore_s"] = ev["restore_s"]

    # --- the reader task -------------------------------------------------------------------

    async def _read(self) -> None:
        pending: int | None = None  # snapshots still being written once the run ended
        try:
            while pending is None or pending > 0:
                ev = await self._next()
                kind = ev["event"]
                if kind == "token":
                    if self.ttft_s is None:
                        self.ttft_s = time.perf_counter() - self.prep.arrived_s
                    if ev["id"] is not None:
                        self.gen_ids.append(ev["id"])
                    if ev["text"] and not self._abandoned:
                        self._queue.put_nowait(ev)
                elif kind == "prefill":
                    self._on_prefill(int(ev["n_live"]))
                elif kind in ("saved", "save_failed"):
                    self._saves_seen += 1
                    self._commit(ev)
                    if pending is not None:
                        pending -= 1
                elif kind == "done":
                    await self._on_done(ev)
                    pending = ev["pending_saves"] - self._saves_seen
                elif kind == "cancelled":
                    self.live_n = int(ev["n_live"])
                    await self._end("cancelled", list(self.prep.rendered.ids[: self.live_n]))
                    pending = ev["pending_saves"] - self._saves_seen
                elif kind == "error":
                    raise WorkerFailed(f"worker {self.worker.worker_id}: {ev['message']}")
        except WorkerFailed as e:
            if not self._done:
                self._queue.put_nowait(e)
                await self._end("cancelled" if self._abandoned else "error",
                                list(self.prep.rendered.ids[: self.live_n]))
            else:
                log.warning("saves of this request lost: %s", e.message)
        except asyncio.CancelledError:  # shutdown: the worker is going away too
            await self._end("cancelled", [])
            raise
        except Exception as e:  # a bug here must not leave the worker taken for good
            log.exception("run on worker %d failed", self.worker.worker_id)
            if not self._done:
                self._queue.put_nowait(WorkerFailed(f"{type(e).__name__}: {e}"))
                await self._end("error", [])
        finally:
            await self._close_stream()

    def _commit(self, ev: dict[str, Any]) -> None:
        try:
            self.gw.commit_save(ev, self.tenant, self.d.keyed)
        except Exception as e:  # a cache fault never fails the request
            self.gw.metrics.faults.labels("index").inc()
            log.warning("cache entry at %d tokens not recorded: %s: %s", ev.get("n_tokens", 0),
                        type(e).__name__, e)

    def _on_prefill(self, n_live: int) -> None:
        """A prefill batch is done. A long prefill logs its progress every PROGRESS_LOG_S."""
        self.live_n = n_live
        now = time.perf_counter()
        if now - self._progress_logged_s >= PROGRESS_LOG_S:
            self._progress_logged_s = now
            n, cached = self.usage.prompt_tokens, self.usage.cached_tokens
            rate = (n_live - cached) / max(now - self.prep.arrived_s, 1e-9)
            log.info("%s prefilling %d/%d tokens (%d cached, %.0f tokens/s) worker=%d",
                     self.prep.req.api, n_live, n, cached, rate, self.worker.worker_id)

    async def _on_done(self, ev: dict[str, Any]) -> None:
        fr = ev["finish_reason"]
        self.finish_reason = "stop" if fr == "stop_sequence" else fr
        self.stop_sequence_hit = fr == "stop_sequence"
        self.usage.completion_tokens = ev["n_gen"]
        self.timings.update(prefill_s=ev["prefill_s"], decode_s=ev["decode_s"])
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.prep.arrived_s
        self._queue.put_nowait(None)  # the end of pieces()
        # abandoned: the cancel came too late, the run finished anyway
        await self._end("cancelled" if self._abandoned else "ok",
                        [*self.prep.rendered.ids, *self.gen_ids][: ev["n_live"]])

    async def _end(self, outcome: str, live: list[int]) -> None:
        """The run is over on the worker: count it, log it, release the worker (once)."""
        if self._done:
            return
        self._done = True
        api, u = self.prep.req.api, self.usage
        if outcome == "ok":
            self._record()
        elif not self._abandoned:  # a cancel was counted when it was asked for
            self.gw.metrics.requests.labels(api, outcome).inc()
        if outcome == "cancelled":
            self._queue.put_nowait(None)  # pieces() ends (nobody may be reading any more)
        if outcome != "ok":
            log.info("%s prompt=%d cached=%d source=%s %s live=%d worker=%d", api,
                     u.prompt_tokens, u.cached_tokens, u.source, outcome, len(live),
                     self.worker.worker_id)
        await self.gw.pool.release(self.worker, live, self.tenant)

    # --- the consumer side -----------------------------------------------------------------

    async def pieces(self) -> AsyncIterator[str]:
        """Generated text; ends at `done`. Saves are committed in the background after."""
        ended = False
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item["text"]
        finally:
            if not ended:  # the consumer stopped early: the client went away
                await self.aclose()

    async def text(self) -> str:
        return "".join([p async for p in self.pieces()])

    def _record(self) -> None:
        u, m = self.usage, self.gw.metrics
        api = self.prep.req.api
        m.requests.labels(api, "ok").inc()
        m.prompt_tokens.inc(u.prompt_tokens)
        if u.cached_tokens:
            m.cached_tokens.labels(u.source).inc(u.cached_tokens)
        m.prefilled_tokens.inc(u.prompt_tokens - u.cached_tokens)
        m.generated_tokens.inc(u.completion_tokens)
        if self.d.lookup != "off":
            m.lookups.labels(self.d.lookup).inc()
        m.prefill_seconds.observe(self.timings.get("prefill_s", 0.0))
        if self.ttft_s is not None:
            m.ttft_seconds.labels(api).observe(self.ttft_s)
        plan = self.d.plan
        saves = ",".join(f"{s['reason']}@{s['n_tokens']}" for s in self.d.saves) or "-"
        log.info(
            "%s prompt=%d cached=%d source=%s scope=%s boundary=%s lookup=%s saves=%s "
            "prefill_s=%.3f decode_s=%.3f ttft_s=%.3f gen=%d finish=%s worker=%d%s",
            api, u.prompt_tokens, u.cached_tokens, u.source, format_scope(self.prep.scope),
            self.d.boundary if self.d.boundary is not None else "-", self.d.lookup, saves,
            self.timings.get("prefill_s", 0.0), self.timings.get("decode_s", 0.0),
            self.ttft_s or 0.0, u.completion_tokens, self.finish_reason,
            self.worker.worker_id,
            f" anchor_skipped=\"{plan.anchor_skipped}\"" if plan and plan.anchor_skipped else "")

    async def _close_stream(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            if self._resp is not None:
                self._resp.close()
            try:
                await cm.__aexit__(None, None, None)
            except Exception:  # closing a failed stream
                pass

    async def aclose(self) -> None:
        """Abandon the run (the client went away): the worker stops at its next prefill batch
        or token, keeps what it prefilled for a retry, and the snapshots it already took are
        still committed. A worker that does not take the cancel has its stream closed, which
        cancels the run too (those snapshots are then lost)."""
        if self._abandoned or self._done:
            return
        self._abandoned = True
        self.gw.metrics.requests.labels(self.prep.req.api, "cancelled").inc()
        if not await self.worker.cancel(self.run_id) and not self._done:
            await self._close_stream()  # the reader sees the stream end and releases
