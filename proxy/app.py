"""The aiohttp application: routes, and the lifecycle of everything the requests share.

`make_app(cfg)` opens, in `cleanup_ctx`, the model's template and tokenizer, the LMDB index, and
the worker pool, and closes them in reverse order on shutdown. Handlers parse, call the gateway,
and render; a response is prepared only after the worker accepted the plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import llama_cpp
from aiohttp import web
from prometheus_client import generate_latest

from backend import keys
from backend.index import Index
from proxy import openai_api
from proxy.config import Config
from proxy.errors import ApiError, BadRequest, Unauthorized, anthropic_response, openai_response
from proxy.gateway import Gateway, Run
from proxy.gguf import read_metadata
from proxy.metrics import Metrics
from proxy.template import ChatTemplate
from proxy.tokenizer import load_tokenizer
from proxy.workers import Pool

log = logging.getLogger("prefixgate")

CONFIG = web.AppKey("config", Config)
GATEWAY = web.AppKey("gateway", Gateway)
METRICS = web.AppKey("metrics", Metrics)
POOL = web.AppKey("pool", Pool)
INDEX = web.AppKey("index", Index)
MODEL_ID = web.AppKey("model_id", str)

ErrorRenderer = Callable[[ApiError], web.Response]


def model_id_of(path: str) -> str:
    return Path(path).name.removesuffix(".gguf")


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


def api_key_of(request: web.Request) -> str:
    key = request.headers.get("x-api-key", "")
    auth = request.headers.get("Authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return key


def check_auth(request: web.Request) -> str:
    """The tenant: the API key, checked against --api-keys when given."""
    key = api_key_of(request)
    allowed = request.app.get(ALLOWED_KEYS)
    if allowed is not None and key not in allowed:
        raise Unauthorized("invalid API key: send one of the keys in the --api-keys file as "
                           "x-api-key or Authorization: Bearer")
    return key


ALLOWED_KEYS = web.AppKey("allowed_keys", frozenset)


async def watch_disconnect(request: web.Request, run: Run) -> None:
    """A client gone mid-request cancels its run at once (even during a long prefill)."""
    while True:
        await asyncio.sleep(0.1)
        if request.transport is None or request.transport.is_closing():
            await run.aclose()
            return


async def serve_run(request: web.Request, run: Run,
                    respond: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    watch = asyncio.create_task(watch_disconnect(request, run))
    try:
        return await respond()
    except (ConnectionError, asyncio.CancelledError):
        await run.aclose()
        raise
    finally:
        watch.cancel()
        if not run._done:
            await run.aclose()


# --- OpenAI ------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, chat=False)


async def _openai(request: web.Request, chat: bool) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    api = "openai" if chat else "completions"
    try:
        tenant = check_auth(request)
        body = await read_json(request)
        req = (openai_api.parse_chat if chat else openai_api.parse_completion)(body, tenant)
        run = await gw.start(gw.prepare(req))
    except ApiError as e:
        request.app[METRICS].requests.labels(api, f"error_{e.status}").inc()
        log.info("%s rejected %d: %s", api, e.status, e.message)
        return openai_response(e)
    r = openai_api.Responder(run, request.app[MODEL_ID], chat)
    if req.stream:
        return await serve_run(request, run, lambda: r.stream(request, req.include_usage))
    return await serve_run(request, run, lambda: r.json(request))


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    mid = request.app[MODEL_ID]
    return web.json_response({"object": "list", "data": [{
        "id": mid, "object": "model", "created": int(os.path.getmtime(cfg.model_path)),
        "owned_by": "prefixgate", "context_length": cfg.n_ctx,
        "max_model_len": cfg.n_ctx,
    }]})


async def health(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    workers = [{"id": w.worker_id, "ready": w.ready, "busy": w.busy,
                "live_tokens": len(w.live_ids)} for w in pool.workers]
    ok = pool.all_ready
    return web.json_response({"status": "ok" if ok else "loading", "workers": workers},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    for w in request.app[POOL].workers:
        m.workers_up.labels(str(w.worker_id)).set(1 if w.ready else 0)
        m.workers_busy.labels(str(w.worker_id)).set(1 if w.busy else 0)
    m.queue_depth.set(request.app[POOL].queue_depth)
    return web.Response(body=generate_latest(m.registry),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def props(request: web.Request) -> web.Response:
    cfg, gw, m = request.app[CONFIG], request.app[GATEWAY], request.app[METRICS]
    index = request.app.get(INDEX)
    prompt = m.prompt_tokens._value.get()
    cached = sum(c._value.get() for c in m.cached_tokens._metrics.values())
    return web.json_response({
        "server": "prefixgate",
        "model": request.app[MODEL_ID], "model_path": cfg.model_path,
        "n_ctx": cfg.n_ctx, "workers": len(request.app[POOL].workers),
        "default_generation_settings": {"n_ctx": cfg.n_ctx},
        "cache": {
            "policy": cfg.disk_prefix_cache, "dir": str(cfg.cache_path),
            "min_tokens": cfg.kv_cache_min_tokens,
            "cold_max_tokens": cfg.kv_cache_cold_max_tokens,
            "continued_interval_tokens": cfg.kv_cache_continued_interval_tokens,
            "max_bytes": cfg.cache_max_bytes, "tenant_isolation": cfg.tenant_isolation,
            "entries": len(index) if index is not None else 0,
            "bytes": index.total_bytes() if index is not None else 0,
            "lifetime_hit_ratio": cached / prompt if prompt else 0.0,
        },
        "volatile_patterns": list(gw.normalizer.patterns),
    })


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:  # after the run started, before a response was prepared: a worker lost
        log.warning("%s %s failed %d: %s", request.method, request.path, e.status, e.message)
        if request.path.startswith("/v1/messages"):
            return anthropic_response(e)
        return openai_response(e)
    except web.HTTPNotFound:
        return web.json_response(
            {"error": {"message": f"unknown endpoint {request.method} {request.path}",
                       "type": "not_found_error", "param": None, "code": None}},
            status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response(
            {"error": {"message": f"{request.method} is not allowed on {request.path}",
                       "type": "invalid_request_error", "param": None, "code": None}},
            status=405)


# --- lifecycle ---------------------------------------------------------------------------


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    t0 = time.perf_counter()
    meta = await asyncio.to_thread(read_metadata, cfg.model_path)
    tok = await asyncio.to_thread(load_tokenizer, cfg.model_path, meta)
    template = ChatTemplate(meta.get("tokenizer.chat_template") or "",
                            tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
                            tok.decode([tok.eos_id]) if tok.eos_id is not None else "")
    index = None
    if cfg.disk_prefix_cache != "off":
        cfg.cache_path.mkdir(parents=True, exist_ok=True)
        index = Index(cfg.cache_path)
        report = index.reconcile()
        log.info("cache %s: %d entries, %d bytes; reconcile: %s", cfg.cache_path, len(index),
                 index.total_bytes(), report)
        app[INDEX] = index
    salt = {"model_path": cfg.model_path, "n_ctx": cfg.n_ctx, "type_k": "f16",
            "type_v": "f16", "flash_attn": cfg.flash_attn,
            "lib_version": llama_cpp.__version__}
    pool = Pool(cfg, keys.fingerprint(keys.make_salt(**salt)))  # every worker must match it
    app[POOL] = pool
    gw = Gateway(cfg, template, tok, pool, index, app[METRICS], salt)
    app[GATEWAY] = gw
    app[METRICS].cache_budget_bytes.set(cfg.cache_max_bytes)
    if index is not None:
        gw.evict()
    try:
        await pool.start()
    except BaseException:
        await pool.close()
        if index is not None:
            index.close()
        raise
    log.info("prefixgate ready on http://%s:%d: model %s, %d worker(s), n_ctx %d, "
             "disk cache %s, tokenizer %s (%.1f s)", cfg.host, cfg.port, app[MODEL_ID],
             len(pool.workers), cfg.n_ctx, cfg.disk_prefix_cache, tok.kind,
             time.perf_counter() - t0)
    yield
    await gw.close()
    await pool.close()
    if index is not None:
        index.close()


def make_app(cfg: Config) -> web.Application:
    app = web.Application(client_max_size=256 << 20, middlewares=[error_middleware])
    app[CONFIG] = cfg
    app[METRICS] = Metrics()
    app[MODEL_ID] = model_id_of(cfg.model_path)
    if cfg.api_keys:
        lines = Path(cfg.api_keys).read_text().splitlines()
        app[ALLOWED_KEYS] = frozenset(k.strip() for k in lines if k.strip())
    app.cleanup_ctx.append(lifecycle)
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_get("/v1/models", models)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/props", props)
    with contextlib.suppress(ImportError):
        from proxy import anthropic_api

        anthropic_api.add_routes(app)
    return app
