"""What both API edges share: the app's typed state, auth, the JSON body, the handler skeleton,
SSE responses, the cache headers, the model card, and noticing a client that left.

An API module (openai_api.py, anthropic_api.py) owns its routes, its parsing into a
`ChatRequest` and its rendering; each handler is `serve(request, api, parse, error, respond)`:

    check the key -> read the JSON body (within proxy/limits.py's bounds) -> parse (media
    replaced by a placeholder: one log line, counted) -> prepare
    (render, tokenize) -> start the run (decide, reach the worker)  ...any ApiError so far:
    counted, logged, rendered in the API's own error shape...  -> respond (JSON or SSE),
    abandoning the run if the client goes away

A response is prepared only after the worker accepted the job: a `StreamResponse` cannot change
its status after `prepare()`.

Nothing a client sends is a 500 or a traceback: an exception raised inside the model's chat
template, of any type, is a 400 that names the template; any other exception that is not an
ApiError is a bug, a 500 in the API's own shape, logged once with its traceback; a client that
left is one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import xxhash
from aiohttp import web

from backend.keys import pack_ids
from proxy import limits
from proxy.cache import DiskCache
from proxy.chat import ChatRequest
from proxy.config import Config
from proxy.errors import ApiError, BadRequest, TooLarge, Unauthorized, internal_error
from proxy.gateway import Gateway
from proxy.metrics import Metrics
from proxy.prompt import Prepared
from proxy.run import Run
from proxy.workers import Pool

T = TypeVar("T")

log = logging.getLogger("prefixgate")

CONFIG = web.AppKey("config", Config)
LIMITS = web.AppKey("limits", limits.Limits)
GATEWAY = web.AppKey("gateway", Gateway)
METRICS = web.AppKey("metrics", Metrics)
POOL = web.AppKey("pool", Pool)
CACHE = web.AppKey("cache", DiskCache)
MODEL_ID = web.AppKey("model_id", str)
ALLOWED_KEYS = web.AppKey("allowed_keys", frozenset)
BOOT = web.AppKey("boot", dict)  # {"phase", "ready", "error"}: proxy.app.lifecycle's progress

ErrorResponse = Callable[[ApiError], web.Response]
Parse = Callable[[Any, str], ChatRequest]
Respond = Callable[[web.Request, ChatRequest, Run], Awaitable[web.StreamResponse]]


def model_id_of(path: str) -> str:
    return Path(path).name.removesuffix(".gguf")


def aliases_of(alias: str) -> list[str]:
    """`-a`'s names (comma-separated, given again: more), in llama-server's order (a set's):
    the first is the model's id, the others are shown beside it."""
    return sorted({a.strip() for a in alias.split(",") if a.strip()})


async def read_body(request: web.Request) -> bytes:
    """The raw body (size and encoding checked); `parse_body` then parses it off the loop."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"the request body is over {request.app[LIMITS].max_body_bytes} bytes "
                       "(limit max_body_bytes)") from None
    except web.RequestPayloadError:  # e.g. Content-Encoding: gzip on a body that is not gzip
        request.content.feed_eof()  # handled: aiohttp does not log it again after the response
        encoding = request.headers.get("Content-Encoding", "")
        raise BadRequest(f"the request body could not be decoded as Content-Encoding "
                         f"{encoding!r}; send it uncompressed or correctly encoded") from None
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    return raw


def parse_body(raw: bytes, tenant: str, parse: Parse, bounds: limits.Limits) -> ChatRequest:
    """JSON, checked against proxy/limits.py's bounds, then the API's own parser (blocking:
    tens of ms for a large conversation, so the gateway's render thread runs it)."""
    body = limits.load(raw, bounds)
    limits.check_request(body, bounds)
    return parse(body, tenant)


def api_key_of(request: web.Request) -> str:
    key = request.headers.get("x-api-key", "")
    auth = request.headers.get("Authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return key


def api_path(request: web.Request) -> str:
    """The request's path below llama-server's --api-prefix (the path itself without one)."""
    cfg = request.app.get(CONFIG)
    prefix = cfg.api_prefix if cfg is not None else ""
    return request.path[len(prefix):] or "/" if prefix and request.path.startswith(prefix) \
        else request.path


def check_auth(request: web.Request) -> str:
    """The tenant: the API key, checked against --api-keys when given."""
    key = api_key_of(request)
    try:
        key.encode()
    except UnicodeEncodeError:  # aiohttp keeps a header's invalid UTF-8 as lone surrogates
        raise Unauthorized("invalid API key: it is not valid UTF-8") from None
    allowed = request.app.get(ALLOWED_KEYS)
    if allowed is not None and key not in allowed:
        raise Unauthorized("invalid API key: send one of the keys given with --api-key or in the "
                           "--api-keys file as "
                           "x-api-key or Authorization: Bearer")
    return key


def client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def cache_headers(run: Run) -> dict[str, str]:
    """What the cache did for this request, on both APIs, and its session affinity key."""
    return {"X-Prefixgate-Cached-Tokens": str(run.usage.cached_tokens),
            "X-Prefixgate-Cache-Source": run.usage.source,
            "X-Prefixgate-Worker": run.worker.label,
            "X-Prefixgate-Restore-Seconds": f"{run.timings.get('restore_s', 0.0):.4f}",
            "X-Prefixgate-Affinity": affinity_key(run.headers, run.prep)}


# the session id headers clients send, the most specific first: Claude Code (v2.1.86+), Codex,
# others, and the generic affinity header a load balancer or a gateway may set
SESSION_HEADERS = ("X-Claude-Code-Session-Id", "Session-Id", "Session_Id", "X-Session-Id",
                   "X-Session-Affinity")
STABLE_PREFIX_TOKENS = 4096  # no message start to cut at: this many tokens name the session


def affinity_key(headers: Mapping[str, str], prep: Prepared) -> str:
    """A stable key per session, for a load balancer to keep it on one host (its cache is
    there): `s-` and a hash of the client's session id header where one is sent, else `p-` and
    a hash of the prompt's stable prefix (the tokens before its first user message: system
    prompt and tools). Opaque: the session id itself is not shown."""
    for name in SESSION_HEADERS:
        value = headers.get(name, "").strip()
        if value and len(value) <= 256:
            return "s-" + xxhash.xxh3_64_hexdigest(value.encode())
    r = prep.rendered
    cut = next((p for p, role in r.message_starts if role == "user" and p > 0),
               STABLE_PREFIX_TOKENS)
    return "p-" + xxhash.xxh3_64_hexdigest(pack_ids(r.ids[:cut]))


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
            "context_length": cfg.slot_ctx, "max_model_len": cfg.slot_ctx,
            **({"aliases": aliases} if len(aliases := aliases_of(cfg.alias)) > 1 else {})}


def reject(request: web.Request, api: str, e: ApiError, error: ErrorResponse
           ) -> web.Response:
    """An error before the response started: counted, logged, in the API's own shape."""
    request.app[METRICS].requests.labels(api, f"error_{e.status}").inc()
    log.info("%s rejected %d: %s", api, e.status, e.message)
    resp = error(e)
    if request.content.exception() is not None:  # the body could not be read to its end
        resp.force_close()
    return resp


def failed(request: web.Request, api: str, e: Exception, error: ErrorResponse) -> web.Response:
    """An exception that is not an ApiError: a bug. A 500 in the API's own shape, logged once
    with its traceback."""
    log.error("%s %s: internal error", request.method, request.path, exc_info=e)
    request.app[METRICS].requests.labels(api, "error_500").inc()
    return error(internal_error(e))


def gone(request: web.Request) -> web.Response:
    """The client left: one log line; the response is never sent (aiohttp drops it)."""
    log.info("%s %s: the client went away", request.method, request.path)
    return web.Response(status=499)


async def _watch_disconnect(request: web.Request, run: Run) -> None:
    """A client gone mid-request cancels its run at once (even during a long prefill)."""
    while not client_gone(request):
        await asyncio.sleep(0.1)
    await run.aclose()


def note_media(request: web.Request, api: str, media: tuple[str, ...]) -> None:
    """Media a text-only model gets as placeholders: one log line per request, counted."""
    counts = Counter(media)
    for kind, n in counts.items():
        request.app[METRICS].media_placeholders.labels(kind).inc(n)
    said = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in counts.items())
    log.info("%s: %s replaced by a text placeholder: this model reads text only", api, said)


async def serve(request: web.Request, api: str, parse: Parse, error: ErrorResponse,
                respond: Respond) -> web.StreamResponse:
    """The handler skeleton of every API (see the module docstring)."""
    gw = request.app[GATEWAY]
    try:
        tenant = check_auth(request)
        req = await gw.offload(parse_body, await read_body(request), tenant, parse,
                               request.app[LIMITS])
        if req.media:
            note_media(request, api, req.media)
        run = await gw.start(await gw.prepare(req))
        run.headers = request.headers
    except ApiError as e:
        return reject(request, api, e, error)
    except Exception as e:
        if isinstance(e, ConnectionError) and client_gone(request):
            return gone(request)
        return failed(request, api, e, error)
    watch = asyncio.create_task(_watch_disconnect(request, run))
    try:
        return await respond(request, req, run)
    except ConnectionError:
        await run.aclose()
        if client_gone(request):
            return gone(request)
        raise
    except asyncio.CancelledError:
        await run.aclose()
        if client_gone(request):
            log.info("%s %s: the client went away", request.method, request.path)
        raise
    finally:
        watch.cancel()
        if not run.done:
            await run.aclose()


async def with_pings(items: AsyncIterator[T], interval_s: float,
                     ping: Callable[[], Awaitable[None]]) -> AsyncIterator[T]:
    """`items`, calling `ping` whenever none arrived for interval_s."""

    async def step() -> T:
        return await items.__anext__()

    nxt: asyncio.Task[T] = asyncio.create_task(step())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=interval_s)
            if not done:
                await ping()
                continue
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
            nxt = asyncio.create_task(step())
    finally:
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
