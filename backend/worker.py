"""The worker process: one Engine behind a small HTTP API (Unix socket, or TCP across containers).

    GET  /health  -> {"ready", "worker_id", "n_ctx" (as configured), "n_ctx_actual" (padded by
                      llama.cpp), "n_live", "fingerprint", "model", "pid",
                      "boot_id" (new each start), "flash_attn", "llama_cpp_version",
                      "cache_volume" (the id in its --cache-dir, backend/volume.py)}
    POST /run     -> NDJSON event stream for one plan:
        {"event": "start", "keep", "restored", "restore_s", "faults"}    live tokens kept / restored
        {"event": "prefill", "n_live"}                                   after each prefill batch
        {"event": "token", "id", "text"}                                 one per generated token
        {"event": "done", "finish_reason", "n_gen", "n_live", "prefill_s", "decode_s",
         "pending_saves"}
        {"event": "cancelled", "n_live", "pending_saves"}                 instead of `done`
        {"event": "saved", "n_tokens", "key", "file", "size_bytes", "checksum", "reason", "save_s"}
        {"event": "save_failed", "n_tokens", "key", "reason", "message"}
        {"event": "error", "message"}

The plan (`/run` body): `ids` (the whole prompt), `restore` ([{file, n_tokens}], longest first:
a broken file is reported in `faults` and the next one tried), `saves`
([{n_tokens, key, reason}]), `sampling`, `max_tokens`, `stop`, `grammar`, `live_ok` (false: the
live KV belongs to another tenant and must not be reused), `keep_max` (reuse at most this many),
`run_id` (for `/cancel`).

Blocking llama calls run on one dedicated thread; state files are written on another, after the
state was copied in memory, so a save never delays the first token. `done` comes as soon as
generation ends (the worker is free then); `saved` events follow once each file is durable, and
the stream ends after the last one.

Cancelling: `POST /cancel {"run_id"}` (the plan's `run_id`) stops the run at its next prefill
batch or token; its stream then reports `cancelled` (what is live: the prefilled tokens stay,
a retry reuses them) and goes on with the `saved` events of snapshots already taken, so the
proxy can still commit them. The client closing the stream also cancels the run; nothing more
is written then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llama_cpp
from aiohttp import web

from backend import keys, store, volume
from backend.engine import Cancel, Cancelled, Engine, Sampling, StopMatcher

log = logging.getLogger("prefixgate.worker")

Emit = Callable[[dict[str, Any]], None]


class Worker:
    def __init__(self, engine: Engine, worker_id: int, cache_dir: Path, fingerprint: bytes,
                 model_path: str, flash_attn: bool = False, n_ctx: int = 0) -> None:
        self.engine = engine
        self.n_ctx = n_ctx or engine.n_ctx  # as configured; llama.cpp may pad it up
        self.worker_id = worker_id
        self.cache_dir = cache_dir
        self.fingerprint = fingerprint
        self.model_path = model_path
        self.flash_attn = flash_attn
        self.boot_id = uuid.uuid4().hex  # new on every start: the proxy detects a restart
        self.llama_thread = ThreadPoolExecutor(1, thread_name_prefix="llama")
        self.writer_thread = ThreadPoolExecutor(1, thread_name_prefix="writer")
        self.runs: dict[str, Cancel] = {}  # run id -> its cancel flag, while it streams

    # --- runs on the llama thread ----------------------------------------------------------

    def execute(self, plan: dict[str, Any], emit: Emit, cancel: Cancel) -> None:
        eng = self.engine
        ids: list[int] = plan["ids"]
        t0 = time.perf_counter()
        # the last two prompt tokens are always evaluated; the proxy may cap reuse lower so that
        # a scope boundary that reuse passed can still be snapshotted
        last = min(max(len(ids) - 2, 0), int(plan.get("keep_max", len(ids))))
        live_ok = plan.get("live_ok", True)  # false: the live KV is another tenant's
        keep = min(eng.live_prefix(ids), last) if live_ok else 0
        restored, faults = 0, []
        for r in plan.get("restore") or ():  # longest first: the next one if one is broken
            if r["n_tokens"] <= keep:
                break
            try:
                n, state = store.read_state_file(self.cache_dir / r["file"], self.fingerprint, ids)
                if n != r["n_tokens"]:
                    raise store.CacheFault("tokens", f"file holds {n} tokens, index said "
                                                     f"{r['n_tokens']}")
                eng.restore(ids[:n], state)
                restored, keep = n, min(n, last)
                break
            except store.CacheFault as e:
                faults.append({"reason": e.reason, "message": str(e), "file": r["file"]})
            except ValueError as e:
                faults.append({"reason": "corrupt", "message": str(e), "file": r["file"]})
            # a failed restore may have cleared the live KV
            keep = min(eng.live_prefix(ids), last) if live_ok else 0
        eng.truncate(keep)
        restore_s = time.perf_counter() - t0
        emit({"event": "start", "keep": keep, "restored": restored, "restore_s": restore_s,
              "faults": faults})

        saves = {int(s["n_tokens"]): s for s in plan.get("saves", ())}
        pending: list[Future[None]] = []

        def snapshot_at(p: int) -> None:
            state = eng.snapshot()
            pending.append(self.writer_thread.submit(self._write, saves[p], ids[:p], state, emit))

        try:
            eng.prefill(ids, list(saves), snapshot_at, cancel,
                        lambda n: emit({"event": "prefill", "n_live": n}))
            self._generate(plan, emit, cancel, t0, pending)
        except Cancelled:  # what it prefilled stays live; snapshots taken are still written
            emit({"event": "cancelled", "n_live": eng.exact_n, "pending_saves": len(pending)})

    def _generate(self, plan: dict[str, Any], emit: Emit, cancel: Cancel, t0: float,
                  pending: list[Future[None]]) -> None:
        eng = self.engine
        t1 = time.perf_counter()
        sampling = Sampling.from_json(plan.get("sampling") or {})
        grammar = None
        if plan.get("grammar"):
            grammar = llama_cpp.LlamaGrammar.from_string(plan["grammar"], verbose=False)
        matcher = StopMatcher(plan.get("stop") or [])
        finish, n_gen = "length", 0
        for token, piece, eog in eng.generate(sampling, int(plan["max_tokens"]), cancel, grammar):
            if eog:
                finish = "stop"
                break
            n_gen += 1
            text, hit = matcher.feed(piece)
            emit({"event": "token", "id": token, "text": text})
            if hit:
                finish = "stop_sequence"
                break
        tail = matcher.flush() if finish != "stop_sequence" else ""
        if tail:
            emit({"event": "token", "id": None, "text": tail})
        emit({"event": "done", "finish_reason": finish, "n_gen": n_gen, "n_live": eng.exact_n,
              "prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1,
              "pending_saves": len(pending)})

    # --- runs on the writer thread ---------------------------------------------------------

    def _write(self, save: dict[str, Any], ids: list[int], state: bytes, emit: Emit) -> None:
        t0 = time.perf_counter()
        key = keys.CacheKey(bytes.fromhex(save["key"]))
        base = {"n_tokens": len(ids), "key": save["key"], "reason": save["reason"]}
        try:
            path, size, checksum = store.write_state_file(
                self.cache_dir, key, self.fingerprint, ids, state
            )
        except store.CacheFault as e:
            emit({"event": "save_failed", **base, "fault": e.reason, "message": str(e)})
            return
        emit({"event": "saved", **base, "file": str(path.relative_to(self.cache_dir)),
              "size_bytes": size, "checksum": checksum, "save_s": time.perf_counter() - t0})

    # --- HTTP ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({
            "ready": True, "worker_id": self.worker_id, "n_ctx": self.n_ctx,
            "n_ctx_actual": self.engine.n_ctx,
            "n_live": self.engine.n_live, "fingerprint": self.fingerprint.hex(),
            "model": self.model_path, "pid": os.getpid(), "boot_id": self.boot_id,
            "flash_attn": self.flash_attn, "llama_cpp_version": llama_cpp.__version__,
            "cache_volume": volume.read(self.cache_dir),
        })

    async def run(self, request: web.Request) -> web.StreamResponse:
        plan = await request.json()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        cancel = Cancel()
        run_id = str(plan.get("run_id") or uuid.uuid4().hex)
        self.runs[run_id] = cancel

        def emit(event: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        def job() -> None:
            try:
                self.execute(plan, emit, cancel)
            except Exception as e:  # the request fails, the worker lives on
                log.exception("run failed")
                emit({"event": "error", "message": f"{type(e).__name__}: {e}"})

        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        running = loop.run_in_executor(self.llama_thread, job)
        watch = asyncio.create_task(self._watch(request, cancel))
        gone = False  # the proxy closed the stream: nothing more is written
        try:
            # `expected`: saves announced by `done` or `cancelled`
            saves_seen, expected = 0, None
            while expected is None or saves_seen < expected:
                event = await queue.get()
                kind = event["event"]
                if kind in ("done", "cancelled"):
                    expected = event["pending_saves"]
                elif kind in ("saved", "save_failed"):
                    saves_seen += 1
                elif kind == "error":
                    expected = saves_seen  # a failed run's pending writes are not awaited
                gone = gone or request.transport is None or request.transport.is_closing()
                if not gone:
                    try:
                        await resp.write(json.dumps(event).encode() + b"\n")
                    except (ConnectionError, RuntimeError):
                        gone = True
                        cancel.set()
            await running
        finally:
            watch.cancel()
            cancel.set()
            self.runs.pop(run_id, None)
        with contextlib.suppress(ConnectionError):  # the proxy may close once it has `done`
            await resp.write_eof()
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        """Stop a run at its next prefill batch or token; its stream goes on to report what is
        live and the snapshots still being written."""
        body = await request.json()
        c = self.runs.get(str(body.get("run_id")))
        if c is None:
            return web.json_response({"cancelled": False}, status=404)
        c.set()
        return web.json_response({"cancelled": True})

    async def _watch(self, request: web.Request, cancel: Cancel) -> None:
        while not cancel.is_set:
            if request.transport is None or request.transport.is_closing():
                cancel.set()
                return
            await asyncio.sleep(0.05)


def make_app(worker: Worker, parent_pid: int | None = None) -> web.Application:
    """`parent_pid`: the proxy that spawned this worker; the worker stops when it is gone."""
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", worker.health)
    app.router.add_post("/run", worker.run)
    app.router.add_post("/cancel", worker.cancel)
    if parent_pid is not None:
        app.cleanup_ctx.append(lambda app: _exit_with_parent(parent_pid))
    return app


PARENT_CHECK_S = 1.0


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


def _env(name: str, default: str) -> str:
    """Flags default to the proxy's PREFIXGATE_* variables, so one .env configures both."""
    return os.environ.get("PREFIXGATE_" + name, default)


def parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT, [IPv6]:PORT or :PORT (all interfaces) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="prefixgate worker",
        description="One llama.cpp context behind the worker API. The proxy spawns these itself "
        "on Unix sockets; for separate containers start one with --listen HOST:PORT and give the "
        "proxy --worker-url http://HOST:PORT. Proxy and worker must use the same model file, "
        "--n-ctx and --flash-attn, and share --cache-dir (one volume). Flags default to the "
        "PREFIXGATE_* environment variables the proxy reads.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", help="Unix socket path (how the proxy runs local workers)")
    where.add_argument("--listen", type=parse_listen, metavar="HOST:PORT",
                       help="listen on TCP, e.g. 0.0.0.0:9000 in a container")
    p.add_argument("--model", default=_env("MODEL", ""),
                   help="GGUF model path (env PREFIXGATE_MODEL; default: the embedded model)")
    p.add_argument("--n-ctx", type=int, default=int(_env("N_CTX", "65536")),
                   help="context tokens (env PREFIXGATE_N_CTX, default 65536)")
    p.add_argument("--threads", type=int, default=int(_env("THREADS", "0")),
                   help="CPU threads, 0 = llama.cpp's default (env PREFIXGATE_THREADS)")
    p.add_argument("--n-gpu-layers", type=int, default=int(_env("N_GPU_LAYERS", "0")),
                   help="layers offloaded to the GPU, -1 = all (env PREFIXGATE_N_GPU_LAYERS)")
    p.add_argument("--flash-attn", action=argparse.BooleanOptionalAction,
                   default=_env("FLASH_ATTN", "").lower() in ("1", "true", "yes", "on"),
                   help="flash attention (env PREFIXGATE_FLASH_ATTN)")
    p.add_argument("--worker-id", type=int, default=0, help="its number in logs")
    p.add_argument("--cache-dir", default=_env("CACHE_DIR", "~/.cache/prefixgate"),
                   help="state files; the proxy's cache directory (env PREFIXGATE_CACHE_DIR)")
    args = p.parse_args(argv)
    logging.basicConfig(level=_env("LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s worker{args.worker_id} %(levelname)s %(message)s")
    if not args.model:
        from proxy.config import default_model  # the CLI entry point may reach the proxy's

        args.model = default_model()
    cache_dir = Path(os.path.expanduser(args.cache_dir))
    engine = Engine(args.model, args.n_ctx, args.threads or None, args.n_gpu_layers,
                    flash_attn=args.flash_attn)
    # salted with n_ctx as configured, as the proxy does: llama.cpp pads it (5000 -> 5024),
    # and the same setting always gives the same padding
    salt = keys.make_salt(args.model, args.n_ctx, "f16", "f16", args.flash_attn,
                          llama_cpp.__version__)
    worker = Worker(engine, args.worker_id, cache_dir, keys.fingerprint(salt), args.model,
                    args.flash_attn, args.n_ctx)
    if args.listen:
        host, port = args.listen
        log.info("worker %d listening on %s:%d (model %s, n_ctx %d, cache %s)", args.worker_id,
                 host, port, args.model, engine.n_ctx, cache_dir)
        web.run_app(make_app(worker), host=host, port=port, print=None, handle_signals=True,
                    access_log=None)
    else:
        if not args.socket:
            p.error("give --listen HOST:PORT (or --socket PATH)")
        if os.path.exists(args.socket):
            os.unlink(args.socket)
        # spawned by the proxy: stop with it
        web.run_app(make_app(worker, parent_pid=os.getppid()), path=args.socket, print=None,
                    handle_signals=True, access_log=None)


if __name__ == "__main__":
    main()
