"""The local worker processes of a `proxy.workers.Pool` (`--workers N`): spawned on a Unix
socket each and waited for while they load, restarted when one exits, stopped with the pool, and
stopped and spawned again around an idle spell (`--sleep-idle-seconds`, llama-server's: the
model leaves memory while nobody asks; what the workers wrote to files is still there after).

A mixin of the Pool: it uses the pool's Config, workers, condition, tasks and checks
(`_adopt`, `_listen`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from policies.prefix import measured_at_start
from proxy.config import worker_argv
from proxy.errors import WorkerFailed
from proxy.worker_link import (
    _UNREACHABLE,
    StartupError,
    Worker,
    WorkerLoading,
    child_env,
    incompatibility,
    loading_note,
    metadata_of,
    worker_gpus,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from backend.keys import CacheIdentity
    from backend.protocol import TierEvent, WorkerInfo
    from proxy.config import Config

log = logging.getLogger("prefixgate.workers")

LOADING_NOTE_S = 15.0  # a local worker still loading its model says so this often


class LocalWorkers:
    cfg: Config
    identity: CacheIdentity | None
    workers: list[Worker]
    sleeping: bool
    _cond: asyncio.Condition
    _waking: asyncio.Lock
    _tasks: list[asyncio.Task[None]]
    _closing: bool
    on_tier: Callable[[str, TierEvent | None], None] | None

    def _adopt(self, w: Worker, h: WorkerInfo) -> None: ...

    async def _listen(self, w: Worker) -> None: ...

    async def _start_local(self) -> None:
        """Spawn every worker (the first alone where it measures what the others recall),
        then supervise them and follow their tier events."""
        if measured_at_start(self.cfg.n_gpu_layers, self.cfg.worker_batch,
                             self.cfg.flash_attn):
            await self._spawn(self.workers[0])
        await asyncio.gather(*(self._spawn(w) for w in self.workers if not w.ready))
        self._tasks = [asyncio.create_task(self._supervise(w)) for w in self.workers]
        self._tasks += [asyncio.create_task(self._listen(w)) for w in self.workers]

    async def _stop_processes(self) -> None:
        """SIGTERM: each writes the states it still holds to files, then exits."""
        for w in self.workers:
            if w.process and w.process.returncode is None:
                w.process.terminate()
        for w in self.workers:
            if w.process:
                try:
                    await asyncio.wait_for(w.process.wait(), 10)
                except asyncio.TimeoutError:
                    w.process.kill()

    # --- asleep (--sleep-idle-seconds: proxy/idle.py says when) ------------------------------

    async def sleep(self) -> None:
        """The local workers leave memory (their live and RAM-tier states with them; what has
        files stays on disk) until a request wakes them (`acquire`)."""
        async with self._waking:
            self.sleeping = True
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            async with self._cond:
                for w in self.workers:
                    w.ready = False
                    w.forget()
                    w.ram = {}
                    if self.on_tier is not None:  # its states are gone (proxy/kv_events.py)
                        self.on_tier(w.name, None)
            await self._stop_processes()

    async def wake(self) -> None:
        """Load the workers again; every request that finds them asleep waits for this one."""
        async with self._waking:
            if not self.sleeping:
                return
            t = time.monotonic()
            log.info("a request wakes the workers: loading them again")
            try:
                await self._start_local()
            except (RuntimeError, StartupError) as e:  # asleep still: the next request retries
                await self._stop_processes()
                log.error("the workers could not be loaded again: %s", e)
                raise WorkerFailed(f"the workers could not be loaded again after sleeping "
                                   f"({e}); see the server's log") from None
            self.sleeping = False
            log.info("awake in %.1f s", time.monotonic() - t)

    def _command(self, w: Worker) -> list[str]:
        return [sys.executable, "-m", "proxy.cli", "worker", "--socket", str(w.socket_path),
                "--worker-id", str(w.worker_id), *worker_argv(self.cfg)]

    async def _spawn(self, w: Worker) -> None:
        w.ready = False
        w.forget()
        # the proxy's own tree first, then whatever the proxy was given
        env = child_env(Path(__file__).resolve().parent.parent)
        if self.cfg.shared_tier:  # not on the command line: the URL may hold a password
            env["PREFIXGATE_SHARED_TIER"] = self.cfg.shared_tier
        gpus = worker_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), self.cfg.workers,
                           w.worker_id, self.cfg.n_gpu_layers)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
            log.info("worker %d gets GPU %s (CUDA_VISIBLE_DEVICES)", w.worker_id, gpus)
        w.process = await asyncio.create_subprocess_exec(*self._command(w), env=env)
        await self._wait_ready(w)

    async def _wait_ready(self, w: Worker) -> None:
        """As long as its process lives: a 60 GB model from a slow disk loads for minutes (no
        fixed limit, as in llama-server); it says every LOADING_NOTE_S how far it got."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        note = start + LOADING_NOTE_S
        log.info("worker %d loading %s", w.worker_id, os.path.basename(self.cfg.model_path))
        while True:
            if w.process and w.process.returncode is not None:
                raise RuntimeError(f"worker {w.worker_id} exited with {w.process.returncode} "
                                   "while starting (see its log above)")
            try:
                h = await w.health()
                break
            except _UNREACHABLE as e:
                if isinstance(e, WorkerLoading):
                    w.loading = e.status
                if loop.time() >= note:
                    log.info("worker %d is loading %s: %s, %.0f s", w.worker_id,
                             os.path.basename(self.cfg.model_path), loading_note(w.loading),
                             loop.time() - start)
                    note += LOADING_NOTE_S
                await asyncio.sleep(0.1)
        problem = incompatibility(h, self.identity, self.cfg.n_ctx, self.cfg.model_path, "",
                                  self.cfg.parallel, metadata_of(self.cfg))
        if problem:
            raise StartupError(f"{w.name}: {problem}")
        self._adopt(w, h)
        async with self._cond:
            w.ready = True
            self._cond.notify_all()
        log.info("worker %d ready (pid %s, n_ctx %d, %s)", w.worker_id,
                 w.process.pid if w.process else "-", w.n_ctx, w.memory_note)

    async def _supervise(self, w: Worker) -> None:
        """Restart a worker process that exits; its in-flight request fails on its own."""
        while not self._closing:
            assert w.process is not None
            rc = await w.process.wait()
            if self._closing:
                return
            w.ready = False
            w.restarts += 1
            log.error("worker %d exited with %s; restarting", w.worker_id, rc)
            try:
                await self._spawn(w)
            except RuntimeError as e:
                log.error("%s", e)
                await asyncio.sleep(1.0)
