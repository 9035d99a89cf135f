"""The worker process: one Engine behind a small HTTP API (Unix socket, or TCP across containers).

    GET  /health  -> {"ready", "worker_id", "n_ctx", "n_live", "fingerprint", "model"}
    POST /run     -> NDJSON event stream for one plan:
        {"event": "start", "keep", "restored", "restore_s", "fault"}     live tokens kept / restored
        {"event": "token", "id", "text"}                                 one per generated token
        {"event": "done", "finish_reason", "n_gen", "n_live", "prefill_s", "decode_s",
         "pending_saves"}
        {"event": "saved", "n_tokens", "key", "file", "size_bytes", "checksum", "reason", "save_s"}
        {"event": "save_failed", "n_tokens", "key", "reason", "message"}
        {"event": "error", "message"}

The plan (`/run` body): `ids` (the whole prompt), `restore` ({file, n_tokens} or null), `saves`
([{n_tokens, key, reason}]), `sampling`, `max_tokens`, `stop`, `grammar`, `live_ok` (false: the
live KV belongs to another tenant and must not be reused), `keep_max` (reuse at most this many).

Blocking llama calls run on one dedicated thread; state files are written on another, after the
state was copied in memory, so a save never delays the first token. `done` comes as soon as
generation ends (the worker is free then); `saved` events follow once each file is durable, and
the stream ends after the last one. The client closing the stream cancels the run at the next
prefill batch or token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llama_cpp
from aiohttp import web

from backend import keys, store
from backend.engine import Cancel, Cancelled, Engine, Sampling, StopMatcher

log = logging.getLogger("prefixgate.worker")

Emit = Callable[[dict[str, Any]], None]


class Worker:
    def __init__(self, engine: Engine, worker_id: int, cache_dir: Path, fingerprint: bytes,
                 model_path: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.cache_dir = cache_dir
        self.fingerprint = fingerprint
        self.model_path = model_path
        self.llama_thread = ThreadPoolExecutor(1, thread_name_prefix="llama")
        self.writer_thread = ThreadPoolExecutor(1, thread_name_prefix="writer")

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
        restored, fault = 0, None
        restore = plan.get("restore")
        if restore and restore["n_tokens"] > keep:
            try:
                n, state = store.read_state_file(
                    self.cache_dir / restore["file"], self.fingerprint, ids
                )
                if n != restore["n_tokens"]:
                    raise store.CacheFault("tokens", f"file holds {n} tokens, index said "
                                                     f"{restore['n_tokens']}")
                eng.restore(ids[:n], state)
                restored, keep = n, min(n, last)
            except store.CacheFault as e:
                fault = {"reason": e.reason, "message": str(e)}
            except ValueError as e:
                fault = {"reason": "corrupt", "message": str(e)}
        if not restored:
            keep = min(eng.live_prefix(ids), last) if live_ok else 0
        eng.truncate(keep)
        restore_s = time.perf_counter() - t0
        emit({"event": "start", "keep": keep, "restored": restored, "restore_s": restore_s,
              "fault": fault})

        saves = {int(s["n_tokens"]): s for s in plan.get("saves", ())}
        pending: list[Future[None]] = []

        def snapshot_at(p: int) -> None:
            state = eng.snapshot()
            pending.append(self.writer_thread.submit(self._write, saves[p], ids[:p], state, emit))

        eng.prefill(ids, list(saves), snapshot_at, cancel)
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
            "ready": True, "worker_id": self.worker_id, "n_ctx": self.engine.n_ctx,
            "n_live": self.engine.n_live, "fingerprint": self.fingerprint.hex(),
            "model": self.model_path, "pid": os.getpid(),
        })

    async def run(self, request: web.Request) -> web.StreamResponse:
        plan = await request.json()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        cancel = Cancel()

        def emit(event: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        def job() -> None:
            try:
                self.execute(plan, emit, cancel)
            except Cancelled:
                emit({"event": "error", "message": "cancelled", "cancelled": True})
            except Exception as e:  # the request fails, the worker lives on
                log.exception("run failed")
                emit({"event": "error", "message": f"{type(e).__name__}: {e}"})

        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        running = loop.run_in_executor(self.llama_thread, job)
        watch = asyncio.create_task(self._watch(request, cancel))
        try:
            saves_seen, expected = 0, None  # `expected`: saves announced by `done`
            while expected is None or saves_seen < expected:
                event = await queue.get()
                kind = event["event"]
                if kind == "done":
                    expected = event["pending_saves"]
                elif kind in ("saved", "save_failed"):
                    saves_seen += 1
                elif kind == "error":
                    expected = saves_seen  # a failed run's pending writes are not awaited
                if not cancel.is_set:
                    try:
                        await resp.write(json.dumps(event).encode() + b"\n")
                    except (ConnectionError, RuntimeError):
                        cancel.set()
            await running
        finally:
            watch.cancel()
            cancel.set()
        with contextlib.suppress(ConnectionError):  # the proxy may close once it has `done`
            await resp.write_eof()
        return resp

    async def _watch(self, request: web.Request, cancel: Cancel) -> None:
        while not cancel.is_set:
            if request.transport is None or request.transport.is_closing():
                cancel.set()
                return
            await asyncio.sleep(0.05)


def make_app(worker: Worker) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", worker.health)
    app.router.add_post("/run", worker.run)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="prefixgate worker")
    p.add_argument("--socket", help="Unix socket path")
    p.add_argument("--listen", help="HOST:PORT to listen on TCP")
    p.add_argument("--model", required=True)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--n-gpu-layers", type=int, default=0)
    p.add_argument("--flash-attn", action="store_true")
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/prefixgate"))
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PREFIXGATE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s worker{args.worker_id} %(levelname)s %(message)s")
    engine = Engine(args.model, args.n_ctx, args.threads, args.n_gpu_layers,
                    flash_attn=args.flash_attn)
    salt = keys.make_salt(args.model, engine.n_ctx, "f16", "f16", args.flash_attn,
                          llama_cpp.__version__)
    worker = Worker(engine, args.worker_id, Path(args.cache_dir), keys.fingerprint(salt),
                    args.model)
    app = make_app(worker)
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        web.run_app(app, host=host or "127.0.0.1", port=int(port), print=None,
                    handle_signals=True, access_log=None)
    else:
        if args.socket and os.path.exists(args.socket):
            os.unlink(args.socket)
        web.run_app(app, path=args.socket, print=None, handle_signals=True, access_log=None)


if __name__ == "__main__":
    main()
