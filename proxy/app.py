"""The aiohttp application: the lifecycle of everything requests share, the operations routes
(/health, /metrics, /props), and the error middleware. The API routes are the edges' own
(openai_api.py, responses_api.py, anthropic_api.py, llama_api.py for llama-server's native
endpoints, on the shared proxy/edge.py).

`make_app(cfg)` starts, in `cleanup_ctx`, the worker pool (the model file hashed; the first
worker says what devices compute, which completes the cache identity) and meanwhile opens the
prompt builder (the model's template and tokenizer: a template that cannot be used stops the
start at once, and the workers with it), then listens, and opens in the background, once the
workers are ready, the disk cache (the LMDB index reconciled with the files) and the gateway,
as llama-server does: until they are ready /health and
/v1/health answer 503 {"status": "loading", "phase", "progress", "workers"} and every other
path a 503 in its API's shape (`Loading`). A start that fails there stops the server with its
one-line reason (`BOOT["error"]`, said by proxy.cli.serve). Shutdown closes them in reverse
order, after pending cache commits landed.

With --api-keys, /metrics and /props need a key as the APIs do; /health stays open
(orchestrators probe it). The middleware answers every error in the shape of the API the path
belongs to: an exception that is not an ApiError is a bug, a 500 logged once with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import generate_latest

from backend import kv_override
from backend.cpus import usable_cpus
from backend.index import Index
from backend.protocol import placement_note
from backend.shared import STATS as SHARED_STATS
from proxy import anthropic_api, cors, idle, limits, llama_api, openai_api, responses_api, status
from proxy.cache import DiskCache
from proxy.chat import MEDIA_MODE, placeholder
from proxy.config import Config, cache_identity
from proxy.edge import (
    ALLOWED_KEYS,
    BOOT,
    CACHE,
    CONFIG,
    GATEWAY,
    LIMITS,
    METRICS,
    MODEL_ID,
    POOL,
    aliases_of,
    api_path,
    check_auth,
    client_gone,
    gone,
    model_id_of,
)
from proxy.errors import (
    ApiError,
    Loading,
    MethodNotAllowed,
    NotFound,
    anthropic_response,
    internal_error,
    openai_response,
)
from proxy.gateway import Gateway, knobs_of
from proxy.gguf import GGUFError
from proxy.kv_events import KvEvents, open_kv_events, publish_disk
from proxy.metrics import Metrics
from proxy.prompt import PromptBuilder
from proxy.speculation import speculative_settings
from proxy.worker_link import StartupError, cores_note, loading_note
from proxy.workers import Pool

log = logging.getLogger("prefixgate")


def error_response(request: web.Request, e: ApiError) -> web.Response:
    """An error in the shape of the API the path belongs to."""
    if api_path(request).startswith("/v1/messages"):
        return anthropic_response(e)
    return openai_response(e)


# --- operations ------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    ok, body = health_json(request.app)
    return web.json_response(body, status=200 if ok else 503)


def health_json(app: web.Application) -> tuple[bool, dict[str, Any]]:
    """(every worker ready, /health's body)."""
    boot, pool = app[BOOT], app.get(POOL)
    # with --tenant-isolation, nothing tenant-specific to anyone (it takes no key): no slot's
    # live tokens or busy state (an authenticated /slots shows a tenant its own)
    isolated = app[CONFIG].tenant_isolation
    workers = [{"id": w.worker_id, "ready": w.ready, "busy": w.busy, "exact": w.exact,
                **({} if isolated else {
                    "live_tokens": sum(len(s.live_ids) for s in w.slots),
                    "slots": [{"id": s.index, "busy": s.busy, "live_tokens": len(s.live_ids)}
                              for s in w.slots]}),
                **({} if w.ready else {"asleep": True} if pool.sleeping else {
                    "loading": loading_note(w.loading),
                    "progress": w.loading.progress if w.loading is not None else 0.0})}
               for w in (pool.workers if pool is not None else [])]
    if boot["ready"] and pool is not None and (pool.all_ready or pool.sleeping):
        # asleep, it serves: the next request wakes it (proxy/idle.py)
        return True, {"status": "ok", "workers": workers, **(
            {"sleeping": True} if pool.sleeping else {})}
    # a ready worker counts as loaded: once the last one is, the cache index and the gateway
    # still open (it read 0 there, and moved backwards)
    loading = [w.get("progress", 1.0) for w in workers]
    return False, {
        "status": "loading",
        "phase": boot["phase"] if not boot["ready"] else "a worker is (re)starting",
        "progress": round(sum(loading) / len(loading), 3) if loading else 0.0,
        "workers": workers}


async def metrics(request: web.Request) -> web.Response:
    check_auth(request)
    m = request.app[METRICS]
    pool = request.app[POOL]
    for w in pool.workers:
        m.workers_up.labels(str(w.worker_id)).set(1 if w.ready else 0)
        m.workers_busy.labels(str(w.worker_id)).set(1 if w.busy else 0)
        m.workers_exact.labels(str(w.worker_id)).set(1 if w.exact else 0)
        m.slots_busy.labels(str(w.worker_id)).set(sum(s.busy for s in w.slots))
        if w.decode is not None:
            m.decode_independent.labels(str(w.worker_id), w.decode.shape).set(
                1 if w.decode.independent else 0)
    for worker_id, stats in (await pool.worker_stats()).items():
        ram = stats["cache_ram"]
        for stat in SHARED_STATS:  # zero where the worker has no shared tier
            m.shared.labels(str(worker_id), stat).set(stats["shared"].get(stat, 0))
        m.ram_bytes.labels(str(worker_id)).set(ram.get("used_bytes", 0))
        m.ram_budget_bytes.labels(str(worker_id)).set(ram.get("budget_bytes", 0))
        m.ram_entries.labels(str(worker_id)).set(ram.get("entries", 0))
    m.queue_depth.set(request.app[POOL].queue_depth)
    return web.Response(body=generate_latest(m.registry),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def props(request: web.Request) -> web.Response:
    check_auth(request)
    return web.json_response(await props_json(request.app))


async def props_json(app: web.Application) -> dict[str, Any]:
    """/props's body (the server must be ready)."""
    cfg, gw, m = app[CONFIG], app[GATEWAY], app[METRICS]
    cache, pool = app.get(CACHE), app[POOL]
    prompt = m.prompt_tokens._value.get()
    cached = sum(c._value.get() for c in m.cached_tokens._metrics.values())
    stats = await pool.worker_stats()
    return {
        "server": "prefixgate",
        "model": app[MODEL_ID], "model_path": cfg.model_path,
        "n_ctx": cfg.n_ctx, "workers": len(pool.workers),
        # llama-server's fields: the slots, the template in use, the build
        "total_slots": len(pool.slots),
        "chat_template": gw.prompts.template.source,
        "build_info": f"prefixgate {_version('prefixgate')}, llama-cpp-python "
                      f"{_version('llama-cpp-python')}",
        "ubatch_size": pool.batching.size,
        # how the batch was chosen, where a CPU worker measured it (backend/worker/batch.py)
        "ubatch_note": next((str(w.placement["batch"]) for w in pool.workers
                             if "batch" in w.placement), ""),
        "exact": [{"worker": w.worker_id, "ok": w.exact, "failure": w.exact_failure,
                   "batch_decode": w.decode is not None and w.decode.shape != "apart",
                   "decode": w.decode.shape if w.decode is not None else None,
                   "independent": w.decode.independent if w.decode is not None else None}
                  for w in pool.workers],
        # whether a slot's answer may depend on other slots generating at the same time, and
        # what the other choice costs (policies.schedule.choose_decode)
        "deterministic": {"asked": cfg.deterministic, "workers": {
            str(w.worker_id): w.decode.note for w in pool.workers
            if w.decode is not None}},
        # where each worker's model went (devices, weights, KV) and what its memory allows
        "placement": {str(w.worker_id): placement_note(w.placement) for w in pool.workers},
        # CPU workers with more threads than the host has cores ("": none)
        "cores": cores_note(pool.workers, usable_cpus()),
        "memory": {str(w.worker_id): w.memory for w in pool.workers},
        # what each worker measured prefill and restores to cost: decide restores only what
        # is faster than prefilling it (policies.costs)
        "costs": {str(w.worker_id): w.costs.summary() if w.costs else {}
                  for w in pool.workers},
        "default_generation_settings": speculative_settings(
            {"n_ctx": cfg.slot_ctx, **gw.defaults.props()}, cfg),
        # speculative decoding (proxy/speculation.py): as asked, and each worker's own: whether
        # it drafts, why not, its verify cost, the drafted and accepted tokens per source
        "speculation": {"type": cfg.spec_type, "stop": cfg.spec_stop, "workers": {
            str(k): v.get("speculation", {}) for k, v in stats.items()}},
        # llama-server's flags and variables accepted with no effect here (proxy/llama_cli.py)
        "llama_server_notes": list(cfg.llama_notes),
        # the workers left memory after --sleep-idle-seconds (proxy/idle.py); a request wakes them
        "is_sleeping": pool.sleeping, "sleep_idle_seconds": cfg.sleep_idle_seconds,
        # which web pages of another origin may call the API (proxy/cors.py)
        "cors": {"origins": cfg.cors_origins, "note": cors.Cors.of(cfg).describe()},
        "cache_ram": {"mib": cfg.cache_ram,
                      "workers": {str(k): v["cache_ram"] for k, v in stats.items()}},
        "shared_tier": {"on": bool(cfg.shared_tier),
                        "workers": {str(k): v["shared"] for k, v in stats.items()}},
        # the host's KV events for a KV-aware router (proxy/kv_events.py, docs/routing.md)
        "kv_events": app[KV_EVENTS].props() if KV_EVENTS in app else None,
        "cache": {
            "policy": cfg.disk_prefix_cache, "dir": str(cfg.cache_path),
            "min_tokens": cfg.kv_cache_min_tokens,
            "cold_max_tokens": cfg.kv_cache_cold_max_tokens,
            "continued_interval_tokens": cfg.kv_cache_continued_interval_tokens,
            "max_bytes": cfg.cache_max_bytes, "tenant_isolation": cfg.tenant_isolation,
            "entries": len(cache) if cache is not None else 0,
            "bytes": cache.total_bytes if cache is not None else 0,
            "lifetime_hit_ratio": cached / prompt if prompt else 0.0,
        },
        # what a text-only model does with an image, audio, a file or a document
        "media": {"mode": MEDIA_MODE, "placeholder": placeholder("image")},
        "volatile_patterns": list(gw.prompts.normalizer.patterns),
        "stable_layout": cfg.stable_layout,
        "volatile_blocks": list(gw.prompts.layout.patterns),
    }


OPEN_WHILE_LOADING = ("/health", "/v1/health", "/")  # the status page says how far it got


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    try:
        boot = request.app.get(BOOT)  # (an app of a test may have none: it is ready)
        if boot is not None and not boot["ready"] and api_path(request) not in OPEN_WHILE_LOADING:
            raise Loading(boot["phase"])
        return await handler(request)
    except ApiError as e:  # after the run started, before a response was prepared: a worker lost
        log.warning("%s %s failed %d: %s", request.method, request.path, e.status, e.message)
        return error_response(request, e)
    except web.HTTPNotFound:
        return error_response(request, NotFound(
            f"unknown endpoint {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return error_response(request, MethodNotAllowed(
            f"{request.method} is not allowed on {request.path}"))
    except web.HTTPException:
        raise
    except Exception as e:
        if isinstance(e, ConnectionError) and client_gone(request):
            return gone(request)
        if request.writer is not None and request.writer.output_size:
            raise  # the response started: aiohttp logs it (once) and drops the connection
        log.error("%s %s: internal error", request.method, request.path, exc_info=e)
        return error_response(request, internal_error(e))


class OneLineRefusals(logging.Filter):
    """aiohttp answers a request its HTTP parser refuses (a malformed chunk, an encoding it
    cannot decode) with a 400 of its own before any handler runs, and logs it with a
    traceback: the client's error, one line is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and exc.code == 400:
            record.msg = f"{record.msg}: refused: {exc.message}"
            record.exc_info, record.exc_text = None, None
        return True


ONE_LINE_REFUSALS = OneLineRefusals()


# --- lifecycle ---------------------------------------------------------------------------


KV_EVENTS = web.AppKey("kv_events", KvEvents)


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    t0 = time.perf_counter()
    # the workers start loading while the template and tokenizer load here: neither needs the
    # other, and a restart waits for the longer of the two, not for both
    workers = asyncio.create_task(_open_pool(app))
    try:
        prompts = await asyncio.to_thread(_load_prompts, cfg)
    except BaseException:  # the start stops: no worker process is left behind
        workers.cancel()
        await asyncio.gather(workers, return_exceptions=True)
        await _close(app)
        raise
    starting = asyncio.create_task(_open(app, prompts, workers, t0))
    yield
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await starting
    await _close(app)


def _load_prompts(cfg: Config) -> PromptBuilder:
    """The model's template and tokenizer; one that cannot be used is a StartupError (one
    line)."""
    try:
        return PromptBuilder.load(cfg.model_path, cfg.volatile_patterns, cfg.volatile_blocks,
                                  cfg.stable_layout, cfg.chat_template_file, cfg.tool_dialect,
                                  cfg.chat_template, cfg.override_kv)
    except GGUFError as e:  # the model changed under us since proxy.cli checked it
        raise StartupError(f"the model {e}") from None
    except kv_override.Mismatch as e:
        raise StartupError(str(e)) from None
    except (jinja2.TemplateError, OSError, UnicodeDecodeError) as e:  # said in one line
        where = "--chat-template" if cfg.chat_template else cfg.chat_template_file or \
            f"{cfg.model_path} (its tokenizer.chat_template)"
        line = f" line {e.lineno}:" if isinstance(e, jinja2.TemplateSyntaxError) else ""
        raise StartupError(f"the chat template in {where} cannot be used:{line} {e}") from None


async def _open_pool(app: web.Application) -> Pool:
    """The model file hashed, the workers started (they say what computes: the identity is
    complete then)."""
    cfg, boot = app[CONFIG], app[BOOT]
    boot["phase"] = "hashing the model file"
    identity = await asyncio.to_thread(cache_identity, cfg)
    await asyncio.to_thread(identity.fingerprint)  # the hash, off the loop, once
    boot["phase"] = "loading the model"
    pool = Pool(cfg, identity)  # every worker must match
    app[POOL] = pool
    events = open_kv_events(cfg, pool)
    if events is not None:
        app[KV_EVENTS] = events
    await pool.start()
    return pool


async def _open(app: web.Application, prompts: PromptBuilder, workers: asyncio.Task[Pool],
                t0: float) -> None:
    """Everything after the listener is up: on a failure the server stops (BOOT["error"])."""
    cfg, boot = app[CONFIG], app[BOOT]
    try:
        pool = await workers
        events = app.get(KV_EVENTS)
        if cfg.disk_prefix_cache != "off":
            boot["phase"] = "reading the cache index"
            cfg.cache_path.mkdir(parents=True, exist_ok=True)
            assert pool.identity is not None
            cache = DiskCache(Index(cfg.cache_path), pool.identity, knobs_of(cfg),
                              cfg.cache_max_bytes, app[METRICS])
            app[CACHE] = cache
            await asyncio.to_thread(cache.load)
            if events is not None:
                await asyncio.to_thread(publish_disk, events, cache)
        gw = Gateway(cfg, prompts, pool, app.get(CACHE), app[METRICS])
        app[GATEWAY] = gw
        await gw.open()
    except asyncio.CancelledError:
        raise
    except Exception as e:  # StartupError, a worker that died loading, a cache dir refused
        boot["error"] = str(e) if isinstance(e, StartupError | RuntimeError | OSError) \
            else f"{type(e).__name__}: {e}"
        log.error("prefixgate cannot start: %s", boot["error"])
        os.kill(os.getpid(), signal.SIGTERM)  # aiohttp stops; proxy.cli.serve says why
        return
    boot["phase"], boot["ready"] = "ready", True
    placement = placement_note(pool.workers[0].placement) if pool.workers else ""
    decode = pool.workers[0].decode if pool.workers else None
    if decode is not None and cfg.parallel > 1:
        placement = f"{decode.note}; {placement}" if placement else decode.note
    keys = app.get(ALLOWED_KEYS)
    log.info("prefixgate ready on http://%s:%d: %s; %s; model %s, %d worker(s) x %d slot(s) of "
             "n_ctx %d, RAM tier %s, disk cache %s, tokenizer %s, tool dialect %s%s%s (%.1f s)",
             cfg.host, cfg.port,
             f"auth on ({len(keys)} API key{'s' if len(keys) > 1 else ''})" if keys else
             "auth OFF (no --api-key: any client is served)", cors.Cors.of(cfg).describe(),
             app[MODEL_ID], len(pool.workers), cfg.parallel, cfg.slot_ctx,
             "off" if cfg.cache_ram == 0 else "unbounded" if cfg.cache_ram < 0
             else f"{cfg.cache_ram} MiB/worker", cfg.disk_prefix_cache,
             prompts.tok.kind, prompts.dialect.name,
             " with <think> reasoning" if prompts.dialect.think else "",
             f"; {placement}" if placement else "", time.perf_counter() - t0)
    if note := cores_note(pool.workers, usable_cpus()):
        log.warning("%s", note)
    if cfg.sleep_idle_seconds > 0:  # until the server stops (this task is cancelled then)
        await idle.watch(pool, cfg.sleep_idle_seconds)


async def _close(app: web.Application) -> None:
    if GATEWAY in app:
        await app[GATEWAY].close()
    if POOL in app:
        await app[POOL].close()
    cache = app.get(CACHE)
    if cache is not None:
        cache.close()
        cache.index.close()
    if KV_EVENTS in app:
        app[KV_EVENTS].close()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def read_key_file(path: str) -> set[str]:
    """The keys of an --api-keys file: one per line; blank lines and lines starting with # (as
    llama-server's --api-key-file) skipped."""
    lines = Path(path).read_text().splitlines()
    return {k.strip() for k in lines if k.strip() and not k.strip().startswith("#")}


def api_keys_of(cfg: Config) -> set[str]:
    """The keys a server (serve, front) accepts: --api-key and the --api-keys file. A file that
    cannot be read or holds no key stops the start in one line that shows neither its path nor
    a key (auth never fails open)."""
    keys = set(cfg.api_key)
    if cfg.api_keys:
        try:
            found = read_key_file(cfg.api_keys)
        except (OSError, UnicodeDecodeError) as e:  # the path is not shown: it may be a key
            raise SystemExit(f"prefixgate: cannot read the --api-keys file: "
                             f"{getattr(e, 'strerror', None) or type(e).__name__}") from None
        if not found:
            raise SystemExit("prefixgate: the --api-keys file holds no API key (only blank "
                             "lines and # comments); put one key per line, or leave it out "
                             "to serve without auth")
        keys |= found
    return keys


def make_app(cfg: Config) -> web.Application:
    bounds = limits.with_overrides(cfg.limits)
    app = web.Application(client_max_size=bounds.max_body_bytes, middlewares=[error_middleware])
    cors.install(app, cors.Cors.of(cfg))
    app[LIMITS] = bounds
    logging.getLogger("aiohttp.server").addFilter(ONE_LINE_REFUSALS)  # once, however many apps
    app[CONFIG] = cfg
    app[METRICS] = Metrics()
    app[MODEL_ID] = next(iter(aliases_of(cfg.alias)), None) or model_id_of(cfg.model_path)
    app[BOOT] = {"phase": "starting", "ready": False, "error": ""}
    keys = set(cfg.api_key)
    if cfg.api_keys:  # read before start (proxy.cli.read_key_file): said in one line there
        keys |= read_key_file(cfg.api_keys)
    if keys:
        app[ALLOWED_KEYS] = frozenset(keys)
    app.cleanup_ctx.append(lifecycle)
    openai_api.add_routes(app)
    anthropic_api.add_routes(app)
    responses_api.add_routes(app)
    llama_api.add_routes(app, health, openai_api.models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/props", props)
    # the status page is everyone's view: under --tenant-isolation it shows no tenant's slot
    status.add_routes(app, props_json, health_json, lambda app: llama_api.slots_json(
        app, "" if app[CONFIG].tenant_isolation else None))
    return app
