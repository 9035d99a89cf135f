"""What both API edges share: the app's typed state, auth, the JSON body, the handler skeleton,
SSE responses, the cache headers, the model card, and noticing a client that left.

An API module (openai_api.py, anthropic_api.py) owns its routes, its parsing into a
`ChatRequest` and its rendering; each handler is `serve(request, api, parse, error, respond)`:

    check the key -> read the JSON body -> parse -> prepare (render, tokenize) -> start the run
    (decide, reach the worker)  ...any ApiError so far: counted, logged, rendered in the API's
    own error shape...  -> respond (JSON or SSE), abandoning the run if the client goes away

A response is prepared only after the worker accepted the job: a `StreamResponse` cannot change
its status after `prepare()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.cache import DiskCache
from proxy.chat import ChatRequest
from proxy.config import Config
from proxy.errors import ApiError, BadRequest, Unauthorized
from proxy.gateway import Gateway
from proxy.metrics import Metrics
from proxy.run import Run
from proxy.workers import Pool

log = logging.getLogger("prefixgate")

CONFIG = web.AppKey("config", Config)
GATEWAY = web.AppKey("gateway", Gateway)
METRICS = web.AppKey("metrics", Metrics)
POOL = web.AppKey("pool", Pool)
CACHE = web.AppKey("cache", DiskCache)
MODEL_ID = web.AppKey("model_id", str)
ALLOWED_KEYS = web.AppKey("allowed_keys", frozenset)

ErrorResponse = Callable[[ApiError], web.Response]
Parse = Callable[[Any, str], ChatRequest]
Respond = Callable[[web.Request, ChatRequest, Run], Awaitable[web.StreamResponse]]


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


def client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def cache_headers(run: Run) -> dict[str, str]:
    """What the cache did for this request, on both APIs."""
    return {"X-Prefixgate-Cached-Tokens": str(run.usage.cached_tokens),
            "X-Prefixgate-Cache-Source": run.usage.source,
            "X-Prefixgate-Worker": str(run.worker.worker_id),
            "X-Prefixgate-Restore-Seconds": f"{run.timings.get('restore_s', 0.0):.4f}"}


async def sse_response(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    return resp


def model_card(app: web.Application) -> dict[str, Any]:
    """The served model, in both APIs' fields (Hermes reads max_model_len / context_length)."""
    cfg, mid = app[CONFIG], app[MODEL_ID]
    created = int(os.path.getmtime(cfg.model_path))
    return {"id": mid, "object": "model", "created": created, "owned_by": "prefixgate",
            "context_length": cfg.n_ctx, "max_model_len": cfg.n_ctx}


async def _watch_disconnect(request: web.Request, run: Run) -> None:
    """A client gone mid-request cancels its run at once (even during a long prefill)."""
    while not client_gone(request):
        await asyncio.sleep(0.1)
    await run.aclose()


async def serve(request: web.Request, api: str, parse: Parse, error: ErrorResponse,
                respond: Respond) -> web.StreamResponse:
    """The handler skeleton of both APIs (see the module docstring)."""
    gw = request.app[GATEWAY]
    try:
        tenant = check_auth(request)
        req = parse(await read_json(request), tenant)
        run = await gw.start(gw.prepare(req))
    except ApiError as e:
        request.app[METRICS].requests.labels(api, f"error_{e.status}").inc()
        log.info("%s rejected %d: %s", api, e.status, e.message)
        return error(e)
    watch = asyncio.create_task(_watch_disconnect(request, run))
    try:
        return await respond(request, req, run)
    except (ConnectionError, asyncio.CancelledError):
        await run.aclose()
        raise
    finally:
        watch.cancel()
        if not run.done:
            await run.aclose()
