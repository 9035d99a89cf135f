"""Worker supervision and the pool the gateway draws workers from.

Each local worker is a `prefixgate worker` process on a Unix socket; a remote one is a URL. The
pool knows each worker's live token ids (what was sent plus what was generated, as the worker
reported), routes with `policies.router`, and queues at most `max_queue` requests: past that,
429. A worker that dies is restarted; the request it was running fails cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from policies.prefix import common_prefix_len
from policies.router import WorkerView, choose_worker
from proxy.config import Config
from proxy.errors import QueueFull, WorkerFailed

log = logging.getLogger("prefixgate.workers")

HEALTH_TIMEOUT_S = 180.0  # model load time allowed at start


@dataclass(eq=False)
class Worker:
    worker_id: int
    base_url: str  # "http://worker" over a Unix socket, or a remote http://host:port
    socket_path: str | None = None
    session: aiohttp.ClientSession | None = None
    process: asyncio.subprocess.Process | None = None
    live_ids: list[int] = field(default_factory=list)  # the proxy's view of its live KV
    live_tenant: str = ""  # whose prompt the live KV holds (tenant isolation)
    busy: bool = False
    ready: bool = False
    n_ctx: int = 0
    fingerprint: str = ""
    restarts: int = 0

    def live_prefix(self, ids: list[int] | tuple[int, ...], tenant: str) -> int:
        """Tokens of `ids` its live KV holds that this tenant may reuse."""
        if tenant != self.live_tenant:
            return 0
        return common_prefix_len(self.live_ids, ids)

    def view(self, ids: list[int], tenant: str) -> WorkerView:
        return WorkerView(self.worker_id, self.live_prefix(ids, tenant), self.busy, self.ready)

    async def health(self, timeout_s: float = 2.0) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(self.base_url + "/health",
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            r.raise_for_status()
            return dict(await r.json())

    @contextlib.asynccontextmanager
    async def run(self, plan: dict[str, Any], timeout_s: float
                  ) -> AsyncIterator[aiohttp.ClientResponse]:
        assert self.session is not None
        try:
            async with self.session.post(self.base_url + "/run", json=plan,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                r.raise_for_status()
                yield r
        except (aiohttp.ClientError, OSError) as e:
            raise WorkerFailed(f"worker {self.worker_id} failed: {e}") from e


class Pool:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.workers: list[Worker] = []
        self._cond = asyncio.Condition()
        self._waiting = 0
        self._tmpdir = tempfile.mkdtemp(prefix="prefixgate-")
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        for i in range(self.cfg.workers):
            sock = os.path.join(self._tmpdir, f"worker{i}.sock")
            w = Worker(i, "http://worker", socket_path=sock)
            w.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock))
            self.workers.append(w)
        await asyncio.gather(*(self._spawn(w) for w in self.workers))
        self._tasks = [asyncio.create_task(self._supervise(w)) for w in self.workers]

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for w in self.workers:
            if w.process and w.process.returncode is None:
                w.process.terminate()
        for w in self.workers:
            if w.process:
                try:
                    await asyncio.wait_for(w.process.wait(), 10)
                except asyncio.TimeoutError:
                    w.process.kill()
            if w.session:
                await w.session.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._tmpdir):
                os.unlink(os.path.join(self._tmpdir, name))
            os.rmdir(self._tmpdir)

    def _command(self, w: Worker) -> list[str]:
        c = self.cfg
        cmd = [sys.executable, "-m", "backend.worker", "--socket", str(w.socket_path),
               "--model", c.model_path, "--n-ctx", str(c.n_ctx),
               "--n-gpu-layers", str(c.n_gpu_layers), "--worker-id", str(w.worker_id),
               "--cache-dir", str(c.cache_path)]
        if c.threads:
            cmd += ["--threads", str(c.threads)]
        if c.flash_attn:
            cmd.append("--flash-attn")
        return cmd

    async def _spawn(self, w: Worker) -> None:
        w.ready = False
        w.live_ids = []
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        w.process = await asyncio.create_subprocess_exec(*self._command(w), env=env)
        await self._wait_ready(w)

    async def _wait_ready(self, w: Worker) -> None:
        deadline = asyncio.get_running_loop().time() + HEALTH_TIMEOUT_S
        while True:
            if w.process and w.process.returncode is not None:
                raise RuntimeError(f"worker {w.worker_id} exited with {w.process.returncode} "
                                   "while starting (see its log above)")
            try:
                h = await w.health()
                w.n_ctx, w.fingerprint = int(h["n_ctx"]), str(h["fingerprint"])
                break
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"worker {w.worker_id} not ready after "
                                       f"{HEALTH_TIMEOUT_S:.0f} s") from None
                await asyncio.sleep(0.1)
        async with self._cond:
            w.ready = True
            self._cond.notify_all()
        log.info("worker %d ready (pid %s, n_ctx %d)", w.worker_id,
                 w.process.pid if w.process else "-", w.n_ctx)

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

    # --- routing ---------------------------------------------------------------------------

    @property
    def all_ready(self) -> bool:
        return bool(self.workers) and all(w.ready for w in self.workers)

    @property
    def queue_depth(self) -> int:
        return self._waiting

    async def acquire(self, ids: list[int], disk_hit: int, tenant: str = "") -> Worker:
        """The worker to run this prompt on, marked busy; waits (bounded) when all are busy."""
        if self._waiting >= self.cfg.max_queue and not any(
                w.ready and not w.busy for w in self.workers):
            raise QueueFull(f"all {len(self.workers)} workers are busy and "
                            f"{self._waiting} requests are waiting; retry shortly")
        self._waiting += 1
        try:
            async with self._cond:
                while True:
                    choice = choose_worker([w.view(ids, tenant) for w in self.workers],
                                           disk_hit)
                    if choice is not None:
                        w = self.workers[choice]
                        if not w.busy:
                            w.busy = True
                            return w
                    await self._cond.wait()
        finally:
            self._waiting -= 1

    async def release(self, w: Worker, live_ids: list[int], tenant: str = "") -> None:
        async with self._cond:
            w.live_ids = live_ids
            w.live_tenant = tenant
            w.busy = False
            self._cond.notify_all()
