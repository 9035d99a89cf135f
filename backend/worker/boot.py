"""A worker from its first second to serving: listen at once, load the model, run (or recall)
the start-up self-check, choose the decode shape, serve.

    serve(WorkerSpec)     `prefixgate worker`: listen, load, serve; a failed load is one line
    load_engine(spec)     the engine as `serve` and `prefixgate doctor` load it
    exactness(...)        the self-check's verdict, logged in one line (`/health`'s "checked")

Until the model is loaded and checked, `/health` answers 503 {"status": "loading", "phase",
"progress"} (llama.cpp's progress callback, 0..1) and `/run` 503, as llama-server does while it
loads. A worker spawned by the proxy stops when the proxy is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiohttp import web

from backend import keys, selfcheck, verdicts
from backend.context import resolve_flash_attn
from backend.engine import Engine
from backend.protocol import DecodeInfo, Loading, placement_note
from backend.ramtier import RamTier
from backend.shared import SharedTier
from backend.worker.batch import engine as measured_engine
from backend.worker.batch import key as measure_key
from backend.worker.core import Core
from backend.worker.draft_model import DraftModel
from backend.worker.server import Worker
from backend.worker.tiers import Tiers
from backend.worker.verify import ROLLBACK_MAX, cost_key, resolve
from policies.prefix import measured_at_start, outputs_max
from policies.schedule import Deterministic, Proof, Shapes, choose_decode
from policies.speculate import SpecConfig

log = logging.getLogger("prefixgate.worker")

PARENT_CHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to run one worker; `prefixgate worker` builds it from the proxy's Config."""

    model_path: str
    n_ctx: int
    threads: int  # 0 = llama.cpp's default
    n_gpu_layers: int
    flash_attn: str  # on | off | auto
    type_k: str  # KV cache types
    type_v: str
    swa_full: bool
    batch: int  # tokens per prefill batch (the reuse granularity)
    exact_check: bool  # run the start-up self-check (backend/selfcheck.py)
    cache_dir: Path
    identity: keys.CacheIdentity
    worker_id: int = 0
    socket: str | None = None  # spawned by the proxy on this Unix socket (and stops with it)
    listen: tuple[str, int] | None = None  # or on TCP, in its own container
    threads_batch: int = 0  # prefill threads; 0 = like threads, else all cores
    # where the weights go (backend/placement.py): split_mode, tensor_split, override_tensor,
    # n_cpu_moe, load_mode, lazy_mode
    placement: dict[str, object] = field(default_factory=dict)
    parallel: int = 1  # slots: sequences in the one context (n_ctx is shared among them)
    cache_ram: int = 0  # MiB of host RAM for states that gave way (-1 no limit, 0 off)
    shared_tier: str = ""  # redis://... of the shared snapshot tier ("" none)
    deterministic: Deterministic = "auto"  # policies.schedule.choose_decode
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding (--spec-type)
    spec_draft_model: str = ""  # a draft model's GGUF (draft-simple)
    spec_draft_ngl: int = 0  # its layers on the GPU
    # llama-server's RoPE settings that were given (backend.context.load's `rope`), and its
    # NUMA word ("" none)
    rope: dict[str, object] = field(default_factory=dict)
    numa: str = ""


def draft_model(spec: WorkerSpec, engine: Engine) -> DraftModel | None:
    """The draft model of draft-simple, loaded beside the model (a ValueError in one line
    where it cannot draft for it)."""
    if "draft-simple" not in spec.spec.types:
        return None
    return DraftModel.load(spec.spec_draft_model, engine, spec.spec_draft_ngl,
                           spec.threads or None, str(spec.placement.get("override_kv", "")))


def draft_identity(identity: keys.CacheIdentity, model: DraftModel) -> keys.CacheIdentity:
    """What the draft model's states are keyed and checked with (the twins of state files):
    its file and the settings its context runs with, on the same devices' kind as the model's."""
    eng = model.engine
    return replace(identity, model_path=model.path, n_ctx=eng.n_ctx, type_k="f16",
                   type_v="f16", flash_attn=eng.flash_attn, swa_full=True, batch=eng.n_batch,
                   compute=eng.compute)


def load_engine(spec: WorkerSpec, progress: Callable[[float], None] | None = None,
                measuring: Callable[[float], None] | None = None) -> Engine:
    """The worker's engine, as `serve` and `prefixgate doctor` load it; on a CPU, at the batch
    and flash attention padding `backend.worker.batch` measures (where not given). `progress`
    follows the first load only: an engine made again at the batch measured (from the page
    cache) must not send it back to 0; `measuring`, the measure's."""
    made = 0

    def make(n_batch: int) -> Engine:
        nonlocal made
        made += 1
        return Engine(spec.model_path, spec.n_ctx, spec.threads or None, spec.n_gpu_layers,
                      n_batch=n_batch, flash_attn=spec.flash_attn, type_k=spec.type_k,
                      type_v=spec.type_v, swa_full=spec.swa_full,
                      n_threads_batch=spec.threads_batch or None, placement=spec.placement,
                      n_seq=spec.parallel, progress=progress if made == 1 else None,
                      deterministic=spec.deterministic,
                      outputs=outputs_max(spec.parallel, spec.spec.n_max if spec.spec.on else 0),
                      rollback=min(spec.spec.n_max, ROLLBACK_MAX) if spec.spec.on else 0,
                      rope=spec.rope, numa=spec.numa)
    if not measured_at_start(spec.n_gpu_layers, spec.batch, spec.flash_attn):
        return make(spec.batch)
    return measured_engine(measure_name(spec), spec.worker_id, make, spec.batch,
                           (spec.type_k, spec.type_v), measuring)


def measure_name(spec: WorkerSpec) -> str:
    """The name the batch measure is remembered under (`backend.worker.batch.key`): the same
    for any number of slots, unless several take flash attention off (`--deterministic on`)."""
    return measure_key(spec.identity, {
        "batch": spec.batch, "threads": spec.threads, "threads_batch": spec.threads_batch,
        "placement": spec.placement,
        "deterministic_on": spec.deterministic == "on" and spec.parallel > 1})


def on_instead(spec: WorkerSpec, engine: Engine) -> str:
    """What `--deterministic on` would do instead, where it would turn flash attention off
    (backend.context.resolve_flash_attn); "" elsewhere."""
    if spec.deterministic == "on" or engine.flash_attn == "off" or resolve_flash_attn(
            spec.flash_attn, cpu_only=engine.placement.get("gpu_layers") == 0,
            n_seq=spec.parallel, type_v=spec.type_v, memory=engine.memory,
            deterministic="on") != "off":
        return ""
    return ("flash attention off on this CPU, where decode steps of several slots batch with "
            "each answer its own if the start-up check proves it (else apart); a deep prompt "
            "then prefills up to 2x slower")


def verdict_key(spec: WorkerSpec, engine: Engine, fingerprint: bytes) -> str:
    """The name of the self-check's verdict for this worker (`verdicts.verdict_key`): its cache
    fingerprint and every other setting the engine runs with, as it resolved them; "" under a
    test's injected fault."""
    if os.environ.get("PREFIXGATE_FAULT"):
        return ""
    settings = {"n_ctx": engine.n_ctx, "slots": spec.parallel, "threads": engine.n_threads,
                "threads_batch": engine.n_threads_batch, "gpu_layers": spec.n_gpu_layers,
                "flash_attn": engine.flash_attn, "batch": engine.n_batch,
                "placement": spec.placement}
    return verdicts.verdict_key(fingerprint, settings)


def exactness(engine: Engine, worker_id: int, check: bool, key: str = "",
              progress: Callable[[float], None] | None = None
              ) -> tuple[dict[str, Any], Proof]:
    """The start-up self-check's verdict, logged in one line, and what it proved of decode
    steps of several slots. Where it fails the worker reuses nothing. `key`: the verdict's name
    (`verdicts.verdict_key`); a passing verdict remembered under it stands for the check, a new
    one is remembered ("": neither). `progress`: told the check's fraction done as it runs."""
    if not check:
        if engine.inexact:
            log.warning("worker %d: cache reuse off: %s", worker_id, engine.inexact)
            return {"ok": False, "checked": False, "failure": engine.inexact}, Proof()
        log.info("worker %d: exactness not checked (--no-exact-check)", worker_id)
        return {"ok": True, "checked": False, "failure": ""}, Proof()
    verdict = verdicts.recall(key) if key and not engine.inexact else None
    remembered = verdict is not None
    if verdict is None:
        if not engine.inexact:  # (an inexact configuration fails without a check)
            probe, total = selfcheck.planned_tokens(engine)
            log.info("worker %d: checking exact reuse on this machine once (remembered after "
                     "it passes): %d probe tokens in batches of %d, %d tokens to prefill",
                     worker_id, probe, engine.batching.size, total)
        report = selfcheck.run(engine, progress)
        verdict = dict(report.to_wire())
        if key and report.ok:
            verdicts.remember(key, verdict)
    proof = Proof() if verdict.get("decode") is None else \
        selfcheck.proof_from_wire(verdict["decode"])
    if verdict["ok"]:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(verdict["checked_at"])) \
            if remembered else ""
        log.info("worker %d: exact reuse proven in %.1f s (%s on %d probe tokens, batch %d)%s",
                 worker_id, verdict["seconds"], ", ".join(c["check"] for c in verdict["checks"]),
                 verdict["probe_tokens"], engine.batching.size,
                 f"; remembered from {when}: the same model, settings, build and code "
                 "(`prefixgate doctor` checks again)" if remembered else "")
    else:
        log.warning("worker %d: exactness self-check FAILED (%s): serving without cache "
                    "reuse; `prefixgate doctor` prints the checks", worker_id, verdict["failure"])
    return {"checked": True, **verdict, "remembered": remembered}, proof


MEASURING = "measuring prefill batches on this CPU (once)"


class Boot:
    """The worker from its first second (module docstring). The load runs on its own thread; a
    load that fails stops the process with its one-line reason."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.phase, self.progress, self.step = "loading the model", 0.0, 0.0
        self.worker: Worker | None = None  # set once it serves
        self.shapes: Shapes | None = None
        self.error = ""
        self.started = time.monotonic()
        # a test's injected fault (PREFIXGATE_FAULT=slow-load): a disk that reads slowly
        self.slow = os.environ.get("PREFIXGATE_FAULT", "") == "slow-load"

    def _measuring(self, p: float) -> None:
        self.phase, self.step = MEASURING, p

    def _checking(self, p: float) -> None:
        self.step = p

    def _progress(self, p: float) -> None:
        self.progress = self.step = p
        if self.slow:
            time.sleep(0.02)

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        spec = self.spec
        try:
            engine = load_engine(spec, self._progress, self._measuring)
            self.phase, self.progress, self.step = "self-check", 1.0, 0.0
            identity = replace(spec.identity, compute=engine.compute, batch=engine.n_batch)
            fingerprint = identity.fingerprint()
            key = verdict_key(spec, engine, fingerprint)
            checked, proof = exactness(engine, spec.worker_id, spec.exact_check, key,
                                       self._checking)
            shapes = choose_decode(spec.deterministic, proof, spec.parallel,
                                   on_instead(spec, engine))
            engine.decode_shape = shapes.decode
            ram = RamTier.from_mib(spec.cache_ram)
            tiers = Tiers(spec.cache_dir, fingerprint, ram, engine.prepare, lambda r, e: None,
                          at_rest=None, fault=engine.fault, spare=engine.spare_bytes)
            if spec.shared_tier:
                tiers.shared = SharedTier(spec.shared_tier, fingerprint)
            core = Core(len(engine.seqs), engine.batching, engine.memory.kind == "plain",
                        ram.budget, bool(checked["ok"]), engine.n_ctx,
                        spec=resolve(spec.spec, engine, cost_key(key, spec.spec,
                                                                 spec.spec_draft_model),
                                     spec.worker_id, draft_model(spec, engine)))
            if core.spec is not None and core.spec.model is not None:  # its states' twins
                tiers.draft_fingerprint = draft_identity(identity, core.spec.model).fingerprint()
                tiers.draft_spare = core.spec.model.engine.spare_bytes
            worker = Worker(engine, core, tiers,
                            DecodeInfo(shapes.decode, shapes.independent, spec.deterministic,
                                       shapes.note),
                            spec.worker_id, spec.cache_dir, identity, spec.n_ctx, checked)
        except Exception as e:  # said in one line by `serve`, after the server stopped
            self.error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            loop.call_soon_threadsafe(os.kill, os.getpid(), signal.SIGTERM)
            return
        log.info("worker %d loaded %s in %.1f s: %s%s", spec.worker_id,
                 os.path.basename(spec.model_path), time.monotonic() - self.started,
                 placement_note(engine.placement),
                 f"; flash attention {engine.flash_attn} ({spec.flash_attn} with several slots "
                 "on a CPU and --deterministic on: lets decode steps batch with each answer "
                 "its own)" if engine.flash_attn != spec.flash_attn
                 else "")
        if spec.parallel > 1:
            log.info("worker %d: %s", spec.worker_id, shapes.note)
        if spec.placement.get("repack", "auto") == "auto" and not engine.placement["repack"]:
            log.info("worker %d: weights not repacked for this CPU's AMX kernels, which crash "
                     "on some machines (ggml-org/llama.cpp#20824); --repack uses them",
                     spec.worker_id)
        self.shapes = shapes
        loop.call_soon_threadsafe(self._serve, worker)

    def _serve(self, worker: Worker) -> None:
        assert self.shapes is not None
        worker.start(self.shapes)
        assert worker.loop is not None
        if worker.engine.placement.get("gpu_layers") == 0:  # CPU compute: write at rest
            worker.tiers.at_rest = worker.loop.resting
        self.worker = worker

    async def begin(self, app: web.Application) -> None:
        threading.Thread(target=self.load, args=(asyncio.get_running_loop(),),
                         name="load", daemon=True).start()

    async def shutdown(self, app: web.Application) -> None:
        if self.worker is not None:
            self.worker.close_streams()

    async def close(self, app: web.Application) -> None:
        """After the last stream: the compute loop ends after its step, the queued writes
        finish (the next proxy adopts their files)."""
        if self.worker is not None and self.worker.loop is not None:
            await asyncio.to_thread(self.worker.loop.stop)

    async def health(self, request: web.Request) -> web.Response:
        if self.worker is not None:
            return await self.worker.health(request)
        return web.json_response(Loading(
            self.phase, round(self.progress, 3), self.spec.worker_id, os.getpid(),
            round(time.monotonic() - self.started, 1), round(self.step, 3)).to_wire(),
            status=503)

    async def run(self, request: web.Request) -> web.StreamResponse:
        if self.worker is None:
            return web.json_response({"error": "loading the model"}, status=503)
        return await self.worker.run(request)

    async def cancel(self, request: web.Request) -> web.Response:
        if self.worker is None:
            return web.json_response({"cancelled": False}, status=404)
        return await self.worker.cancel(request)

    async def events(self, request: web.Request) -> web.StreamResponse:
        if self.worker is None:
            return web.json_response({"error": "loading the model"}, status=503)
        return await self.worker.events(request)


def make_app(boot: Boot, parent_pid: int | None = None) -> web.Application:
    """`parent_pid`: the proxy that spawned this worker; the worker stops when it is gone."""
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", boot.health)
    app.router.add_post("/run", boot.run)
    app.router.add_post("/cancel", boot.cancel)
    app.router.add_get("/events", boot.events)
    app.on_startup.append(boot.begin)
    app.on_shutdown.append(boot.shutdown)
    app.on_cleanup.append(boot.close)
    if parent_pid is not None:
        app.cleanup_ctx.append(lambda app: _exit_with_parent(parent_pid))
    return app


async def _exit_with_parent(parent_pid: int) -> AsyncIterator[None]:
    """A proxy killed without a chance to stop its workers (SIGKILL, the OOM killer) must not
    leave them holding the model and its KV: when the parent is gone, stop as on SIGTERM, so
    runs in flight finish writing the snapshots they took (the next proxy adopts them)."""

    async def watch() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(PARENT_CHECK_S)
        log.warning("the proxy (pid %d) is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    task = asyncio.create_task(watch())
    yield
    task.cancel()


def serve(spec: WorkerSpec) -> None:
    """Listen at once (`Boot`), load, serve; a load that failed is a ValueError (one line)."""
    boot = Boot(spec)
    if spec.listen is not None:
        host, port = spec.listen
        log.info("worker %d listening on %s:%d (model %s, cache %s); loading", spec.worker_id,
                 host, port, spec.model_path, spec.cache_dir)
        web.run_app(make_app(boot), host=host, port=port, print=None, handle_signals=True,
                    access_log=None)
    else:
        assert spec.socket is not None
        if os.path.exists(spec.socket):
            os.unlink(spec.socket)
        # spawned by the proxy: stop with it
        web.run_app(make_app(boot, parent_pid=os.getppid()), path=spec.socket, print=None,
                    handle_signals=True, access_log=None)
    if boot.error:
        raise ValueError(boot.error)
    if boot.worker is None:  # stopped while loading: the load thread is not waited for
        logging.shutdown()
        os._exit(0)
