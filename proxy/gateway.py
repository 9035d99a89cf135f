"""Step 4 of a request, and the hand-over to 5 and 6: decide, then start the run.

    Gateway.start(prep) -> Run
        1. read the index once for this prompt, off the event loop (proxy.cache.DiskCache.lookup)
        2. acquire a worker (policies.router: the longest live prefix, the disk hit as a bar)
        3. decide (policies.decide.decide: pure) -> Plan
        4. remember the prompt in the ring (and its persisted copy)
        5. send the job and wait for the worker's Start (proxy.run.Run.open), so that any
           failure is known before an HTTP response is prepared

A short request that finds every slot busy may take the slot of a run still prefilling a long
prompt (policies/preempt.py); that run comes back through `requeue`: steps 1 to 3 again, first
in the queue.

The steps before (parse, normalize, render, tokenize) are the API edges' and proxy/prompt.py's;
the ones after (execute on the worker, commit) are proxy/run.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import xxhash

from backend.keys import prefix_keys
from backend.shared import LOOKUP_TIMEOUT_S, SharedFault, SharedSkipped, SharedTier
from policies.decide import Facts, Hit, Plan, Stored, WorkerFacts, decide
from policies.plan import CacheKnobs
from policies.prefix import common_prefix_len
from policies.ring import Ring
from policies.scope import Scope, parse_scope
from proxy.cache import DiskCache
from proxy.chat import ChatRequest
from proxy.config import Config
from proxy.defaults import Defaults
from proxy.metrics import Metrics
from proxy.prompt import Prepared, PromptBuilder
from proxy.run import Run, RunDeps
from proxy.worker_link import Slot
from proxy.workers import Pool

log = logging.getLogger("prefixgate")

T = TypeVar("T")

RING_CAPACITY = 256  # recent prompts remembered (all tenants together)
SHUTDOWN_COMMIT_WAIT_S = 30.0  # how long a stopping proxy waits for snapshots being written
OFF = Scope("off")
# A request that waited longer than this for a slot reads the index again before deciding: the
# requests served meanwhile may have saved a longer prefix of it (subagents started together
# share their system prompt and tools).
REQUEUED_LOOKUP_S = 0.05
SHARED_CANDIDATES = 2048  # batch edges asked of the shared tier per lookup (at least 16K tokens)
# the longest a request waits for the shared tier's lookup (its own timeout is shorter; this
# bounds the wait for one of its threads as well)
SHARED_LOOKUP_S = 2 * LOOKUP_TIMEOUT_S


def tenant_id(api_key: str) -> str:
    """What identifies a tenant in keys, the ring and the index: a hash, never the key itself."""
    return xxhash.xxh3_128_hexdigest(b"prefixgate-tenant\0" + api_key.encode())


def knobs_of(cfg: Config) -> CacheKnobs:
    return CacheKnobs(cfg.kv_cache_min_tokens, cfg.kv_cache_cold_max_tokens,
                      cfg.kv_cache_continued_interval_tokens)


def facts_of(prep: Prepared, scope: Scope) -> Facts:
    r = prep.rendered
    return Facts(r.ids, r.message_starts, scope)


# the render thread's nice value over the process's: a request's preparation yields the CPU to
# the workers' compute. llama.cpp's threads wait for each other at barriers, so a core taken
# from one of them stops them all: on 2 cores a 24-token prefill took 1.4 s instead of 0.14 s
# while the proxy tokenized another client's text (bench/results/issue46/stall.md)
RENDER_NICE = 10


def below_the_engine() -> None:
    """The render thread's initializer: lower its own priority by RENDER_NICE (Linux sets a
    thread's nice value by its thread id; elsewhere it stays as it is), and name it for `top
    -H` and `ps -L`."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + RENDER_NICE))
    with contextlib.suppress(OSError):
        with open(f"/proc/self/task/{tid}/comm", "w") as comm:
            comm.write("render")


class Gateway:
    def __init__(self, cfg: Config, prompts: PromptBuilder, pool: Pool, cache: DiskCache | None,
                 metrics: Metrics) -> None:
        self.cfg = cfg
        self.prompts = prompts
        self.pool = pool
        self.cache = cache
        self.metrics = metrics
        self.knobs = knobs_of(cfg)
        self.default_scope = parse_scope(cfg.disk_prefix_cache)
        self.ring = Ring(RING_CAPACITY)
        self._background: set[asyncio.Task[None]] = set()
        self._render = ThreadPoolExecutor(1, thread_name_prefix="render",
                                          initializer=below_the_engine)
        self._shared_lookups = ThreadPoolExecutor(2, thread_name_prefix="shared-lookup")
        self.deps = RunDeps(pool, cache, metrics, self.spawn, cfg.request_timeout_s,
                            self.requeue)
        self.shared: SharedTier | None = None  # the shared snapshot tier (--shared-tier)
        # llama-server's server-wide request defaults: the command line's, the model's
        self.defaults = Defaults.of(cfg, prompts.model_keys)
        if self.defaults.sampling:
            log.info("request defaults: %s", ", ".join(
                f"{k} {v} ({self.defaults.source[k]})" for k, v in self.defaults.sampling.items()))
        if self.defaults.unused:
            log.warning("the model's %s not used: llama.cpp reads no such sampler key, or not "
                        "such a value",
                        ", ".join(self.defaults.unused) + (" is" if len(self.defaults.unused)
                                                            == 1 else " are"))

    async def open(self) -> None:
        """The ring survives restarts, so `auto` does too."""
        if self.cache is not None:
            for tenant, ids in await self.cache.read(self.cache.ring_load):
                self.ring.push(tenant, ids)
            if self.cfg.shared_tier:
                self.shared = SharedTier(self.cfg.shared_tier, self.pool.fingerprint,
                                         self.cfg.shared_tier_secret)
                if not self.shared.authenticated:
                    log.warning("shared tier %s runs without a secret (--shared-tier-secret "
                                "or PREFIXGATE_SHARED_TIER_SECRET): whoever can write to it "
                                "can plant states this host loads, and whoever reads it can "
                                "test API key guesses against its tenant tags",
                                self.shared.url)

    async def _lookup(self, facts: Facts, tenant: str) -> Stored:
        """The stored prefixes of this prompt (local, then the shared tier's); none without a
        cache or with scope off."""
        if self.cache is None or facts.scope.kind == "off":
            return Stored()
        stored = await self.cache.read(self.cache.lookup, facts, tenant)
        if self.shared is not None:
            stored = await self._shared_lookup(facts, stored, tenant)
        return stored

    async def _shared_lookup(self, facts: Facts, stored: Stored, tenant: str) -> Stored:
        """A prompt the local tier does not cover: the longest prefix the shared tier holds
        (its candidate keys at every batch edge past the local hit, one round trip), put first
        among the hits as a shared entry (its tier) the worker pulls. A tier that fails is a
        miss."""
        assert self.shared is not None and self.cache is not None
        edges = self.pool.batching.edges(facts.ids)
        top = edges.keep_max
        if stored.longest >= top:
            return stored
        positions = edges.down(top, stored.longest)[:SHARED_CANDIDATES]
        salt = await self.cache.read(self.cache.salt, tenant)
        candidates = {n: bytes(k) for n, k in prefix_keys(salt, facts.ids, positions).items()}
        shared = self.shared
        try:  # on its own threads: a hung Redis never holds up the local index's lookups
            found = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                self._shared_lookups, shared.longest, candidates, tenant), SHARED_LOOKUP_S)
        except SharedSkipped:
            self.metrics.shared_lookups.labels("skipped").inc()
            return stored
        except (SharedFault, asyncio.TimeoutError) as e:
            self.metrics.shared_lookups.labels("error").inc()
            log.warning("shared tier lookup failed (a miss): %s",
                        e if isinstance(e, SharedFault) else "no answer in time")
            return stored
        self.metrics.shared_lookups.labels("hit" if found else "miss").inc()
        if found is None:
            return stored
        n, key, size = found
        return Stored((Hit(n, key, "", size, "shared"), *stored.hits),
                      stored.positions | {n})

    async def offload(self, fn: Callable[..., T], *args: object) -> T:
        """Run CPU work of a request (parse, render, tokenize) on the render thread: one at a
        time (the template's and the tokenizer's caches are not shared across threads), never
        on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._render, fn, *args)

    async def prepare(self, req: ChatRequest) -> Prepared:
        return await self.offload(self.prompts.prepare, self.defaults.apply(req),
                                  self.cfg.slot_ctx, self.default_scope)

    async def start(self, prep: Prepared) -> Run:
        ids = prep.rendered.ids
        tenant = tenant_id(prep.req.tenant) if self.cfg.tenant_isolation else ""
        facts = self._facts(prep)
        stored = await self._lookup(facts, tenant)
        self.metrics.queue_depth.set(self.pool.queue_depth + 1)
        loop = asyncio.get_running_loop()
        asked = loop.time()
        slot = await self.pool.acquire(ids, stored.longest, tenant, prep.max_tokens)
        self.metrics.queue_depth.set(self.pool.queue_depth)
        if slot.outer is not None:  # nested on a generating run (policies/preempt.py rule 4)
            self.metrics.parks.inc()
        try:
            if loop.time() - asked > REQUEUED_LOOKUP_S:  # it waited for a slot: what the
                stored = await self._lookup(facts, tenant)  # others saved meanwhile counts
            plan = self._decide(facts, stored, slot, tenant)
            if facts.scope.kind != "off":
                self.ring.push(tenant, ids)
                if self.cache is not None:
                    self.spawn(self.cache.write(self.cache.ring_push, tenant, ids,
                                                RING_CAPACITY))
            salt = b"" if self.cache is None else await self.cache.read(self.cache.salt, tenant)
            run = Run(self.deps, prep, slot, plan, salt, tenant)
            await run.open()
            await self.pool.hold(slot, run)  # it may give way to a short request now
            return run
        except BaseException:
            await self.pool.release(slot, [], tenant)
            raise

    def _facts(self, prep: Prepared) -> Facts:
        return facts_of(prep, prep.scope if self.cache is not None else OFF)

    def _decide(self, facts: Facts, stored: Stored, slot: Slot, tenant: str) -> Plan:
        recent = self.ring.recent(tenant, facts.scope.window) \
            if facts.scope.kind == "auto" else []
        w = slot.worker
        plan = decide(facts, stored, WorkerFacts(slot.live_prefix(facts.ids, tenant),
                                                 slot.live_tenant == tenant,
                                                 w.memory == "plain", w.batching, w.exact,
                                                 w.costs),
                      recent, self.knobs)
        if self.cfg.debug_trace and plan.lookup == "miss":
            self._trace_miss(facts.ids, tenant)
        return plan

    async def requeue(self, run: Run) -> tuple[Slot, Plan]:
        """A run that gave its slot to a short request: the next free slot, before anyone
        else's turn, and its plan there (what it left is in that worker's RAM tier)."""
        facts = self._facts(run.prep)
        stored = await self._lookup(facts, run.tenant)
        slot = await self.pool.acquire(facts.ids, stored.longest, run.tenant, first=True)
        try:
            return slot, self._decide(facts, stored, slot, run.tenant)
        except BaseException:
            await self.pool.release(slot, [], run.tenant)
            raise

    def _trace_miss(self, ids: tuple[int, ...], tenant: str) -> None:
        best = max(self.ring.recent(tenant, RING_CAPACITY),
                   key=lambda r: common_prefix_len(ids, r), default=None)
        if best is None:
            log.debug("trace: miss, no earlier prompt to compare with")
            return
        i = common_prefix_len(ids, best)
        lo, hi = max(0, i - 4), i + 5
        decode = self.prompts.tok.decode
        log.info("trace: miss; first mismatch at token %d: prompt %s %r vs best earlier %s %r",
                 i, list(ids[lo:hi]), decode(ids[lo:hi]), list(best[lo:hi]),
                 decode(best[lo:hi]))

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
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
        self._render.shutdown(wait=False, cancel_futures=True)
        self._shared_lookups.shutdown(wait=False, cancel_futures=True)
