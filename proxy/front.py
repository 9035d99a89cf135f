"""prefixgate's front for several hosts, placed by NVIDIA Dynamo's KV router (`prefixgate
front`): the host that holds the longest part of a prompt's prefix gets it, whatever session
it belongs to. The placement is Dynamo's `KvRouter` (the router `python -m dynamo.router` and
Dynamo's own frontend run), fed by the hosts' KV events (`prefixgate dynamo-worker`).

    prefixgate front [serve's flags: the model and prompt ones the hosts run with]
        --host 0.0.0.0 --port 8080 [--namespace prefixgate] [--component host]

A request's way:
1. A generation request (`/v1/chat/completions`, `/v1/completions`, `/v1/messages`,
   `/v1/responses`, `/completion`, with or without `/v1`), bounded as a host bounds it
   (proxy/limits.py), is rendered and tokenized here exactly as a host
   renders it (the same `PromptBuilder`, server defaults and flags: give the front the hosts'
   model and prompt flags), off the event loop.
2. Dynamo's router picks the host: `best_worker(ids, request_id)`, its overlap with each
   host's blocks on every tier weighed against each host's load, which the router tracks from
   the requests it placed: `mark_prefill_complete` at the first byte of the answer, `free` at
   its end.
3. The request goes to that host's own HTTP API unchanged, and its answer back byte for byte
   (streams included), with `X-Prefixgate-Upstream` (the host) and `X-Prefixgate-Route` (why).
   A host learns its address from its registration (`proxy/dynamo.py`, asked once per host).

What is not a generation request (`/health`'s own answer aside: ready once a host is known),
and a body that does not parse or render (the host answers it in its API's own error shape),
goes to the hosts in turn. A host that cannot be reached is skipped for the next, once; with
none left the answer is a 503 in the API's error shape. `POST /front/route?path=/v1/...` with a
request's body tells where it would go and why (Dynamo's overlap per host and tier), placing
nothing: how much of a prompt some host holds is for a key holder to see, and no other answer
says it (`X-Prefixgate-Route` names the way, not the overlap).

With `--api-prefix /PATH` (as the hosts run it) the front answers below the prefix only, as a
host does, and forwards the path below it to each host's registered URL, which then names the
host's prefix too (`prefixgate dynamo-worker --host-url http://HOST:8080/PATH`: its health is
probed there as well).

Auth is the server's (docs/security.md): with --api-key or --api-keys every path but `/health`
takes one of the keys at the front, before anything is rendered or placed (a 401 in the API's
shape), and the hosts check it again; a key option that yields no key stops the start; the
start line says `auth on` or `auth OFF`. A key is never logged, nor a host URL's password.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web

from backend.redact import redact_url
from proxy import cors, limits
from proxy.config import Config, add_arguments, configure_logging, from_args
from proxy.edge import ALLOWED_KEYS, CONFIG, api_path, check_auth, parse_body
from proxy.errors import (
    ApiError,
    Unauthorized,
    WorkerFailed,
    anthropic_response,
    openai_response,
)

log = logging.getLogger("prefixgate.front")

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
       "proxy-authenticate", "proxy-authorization", "te", "trailer"}
UPSTREAM_TIMEOUT_S = 3600.0


def _parsers() -> dict[str, Callable[[Any, str], Any]]:
    from proxy import anthropic_api, llama_api, openai_api, responses_api

    return {"/v1/chat/completions": openai_api.parse_chat,
            "/chat/completions": openai_api.parse_chat,
            "/v1/completions": openai_api.parse_completion,
            "/completions": openai_api.parse_completion,
            "/v1/messages": anthropic_api.parse_request,
            "/v1/responses": responses_api.parse_request,
            "/responses": responses_api.parse_request,
            "/completion": llama_api.parse_native}


class Front:
    def __init__(self, cfg: Config, namespace: str, component: str,
                 keys: frozenset[str] = frozenset()) -> None:
        self.cfg, self.path = cfg, f"{namespace}.{component}.generate"
        self.parsers = _parsers()
        self.bounds = limits.with_overrides(cfg.limits)  # a body is bounded as a host's is
        self.builder: Any = None  # proxy.prompt.PromptBuilder, loaded at start
        self.defaults: Any = None  # proxy.defaults.Defaults
        self.router: Any = None  # dynamo.llm.KvRouter
        self.client: Any = None  # the hosts' endpoint client
        self.runtime: Any = None
        self.session: aiohttp.ClientSession | None = None
        self.urls: dict[int, str] = {}  # Dynamo worker id -> the host's URL
        self.keys = keys  # the accepted API keys (none: auth OFF)
        self._turn = itertools.count()

    # --- lifecycle -------------------------------------------------------------------------

    async def open(self, app: web.Application) -> AsyncIterator[None]:
        from dynamo.llm import KvRouter, KvRouterConfig

        from proxy.defaults import Defaults
        from proxy.dynamo import open_runtime
        from proxy.prompt import PromptBuilder

        cfg = self.cfg
        self.builder = await asyncio.to_thread(
            PromptBuilder.load, cfg.model_path, cfg.volatile_patterns, cfg.volatile_blocks,
            cfg.stable_layout, cfg.chat_template_file, cfg.tool_dialect, cfg.chat_template)
        self.defaults = Defaults.of(cfg, self.builder.model_keys)
        self.runtime = await open_runtime()
        endpoint = self.runtime.endpoint(self.path)
        self.client = await endpoint.client()
        self.router = KvRouter(endpoint=endpoint, block_size=cfg.kv_block_size,
                               kv_router_config=KvRouterConfig())
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=UPSTREAM_TIMEOUT_S, sock_connect=10),
            auto_decompress=False)
        n = len(self.keys)
        log.info("prefixgate front on http://%s:%d: hosts of %s placed by Dynamo's KV router "
                 "(blocks of %d tokens), %s", cfg.host, cfg.port, self.path, cfg.kv_block_size,
                 f"auth on ({n} API key{'s' if n > 1 else ''})" if n else
                 "auth OFF (no --api-key: any client is served)")
        yield
        await self.session.close()
        self.runtime.shutdown()

    # --- where a request goes --------------------------------------------------------------

    def prompt_ids(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's token ids as a host renders them; None for anything else (blocking)."""
        parse = self.parsers.get(path)
        if parse is None:
            return None
        try:
            req = self.defaults.apply(parse_body(body, "", parse, self.bounds))
            rendered, _ = self.builder.render(req, self.cfg.slot_ctx)
        except (ApiError, ValueError, TypeError):  # the host says what is wrong, its own way
            return None
        return [int(t) for t in rendered.ids] or None

    async def url_of(self, worker_id: int) -> str | None:
        url = self.urls.get(worker_id)
        if url is None:
            try:
                async for answer in await self.client.direct({}, worker_id):
                    data = answer.data() if callable(getattr(answer, "data", None)) else answer
                    if isinstance(data, dict) and "data" in data and "host_url" not in data:
                        data = data["data"]
                    url = str(data["host_url"]).rstrip("/")
                    break
            except Exception as e:  # gone meanwhile: the next host
                log.warning("Dynamo worker %d did not say its address: %s", worker_id,
                            type(e).__name__)
                return None
            if url is not None:
                self.urls[worker_id] = url
        return url

    async def choose(self, ids: list[int] | None, rid: str, skip: set[int]
                     ) -> tuple[int, str, str] | None:
        """(worker id, its URL, why) of the host for this request, or None for none left."""
        if ids and not skip:
            try:
                worker, _, overlap = await self.router.best_worker(ids, request_id=rid)
                url = await self.url_of(worker)
                if url is not None:
                    log.debug("placed on %s: %d of %d blocks held", redact_url(url), overlap,
                              len(ids) // self.cfg.kv_block_size)
                    return worker, url, "dynamo-kv"
                skip.add(worker)
                await self.router.free(rid)
            except Exception as e:  # no host registered yet, or the router refused
                log.warning("Dynamo's router placed nothing (%s): the hosts in turn", e)
        hosts = sorted(set(self.client.instance_ids()) - skip)
        for worker in hosts[next(self._turn) % len(hosts):] + hosts if hosts else []:
            url = await self.url_of(worker)
            if url is not None:
                return worker, url, "in turn (not a prompt)" if not ids else "in turn"
            skip.add(worker)
        return None

    # --- HTTP ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        n = len(self.client.instance_ids()) if self.client is not None else 0
        return web.json_response({"status": "ok" if n else "no host", "hosts": n},
                                 status=200 if n else 503)

    async def route(self, request: web.Request) -> web.Response:
        """Where a request would go and why, placing nothing."""
        try:
            check_auth(request)
        except Unauthorized as e:
            return openai_response(e)
        path = request.query.get("path", "/v1/chat/completions")
        ids = await asyncio.to_thread(self.prompt_ids, path, await request.read())
        if ids is None:
            return web.json_response({"error": f"not a prompt of {path}"}, status=400)
        scores = await self.router.get_overlap_scores(ids)
        worker, _, overlap = await self.router.best_worker(ids)
        for w in self.client.instance_ids():
            await self.url_of(w)
        return web.json_response({"tokens": len(ids), "best": {
            "worker_id": worker, "url": redact_url(self.urls.get(worker) or ""),
            "overlap_blocks": overlap},
            "hosts": {str(k): redact_url(v) for k, v in self.urls.items()}, "dynamo": scores})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        path = api_path(request)  # below --api-prefix: what the hosts' URLs are given
        try:  # before anything is read, rendered or placed
            check_auth(request)
        except Unauthorized as e:
            return anthropic_response(e) if path.startswith("/v1/messages") \
                else openai_response(e)
        body = await request.read()
        ids = await asyncio.to_thread(self.prompt_ids, path, body) \
            if request.method == "POST" else None
        tail = path + (f"?{request.query_string}" if request.query_string else "")
        rid, skip = uuid.uuid4().hex, set[int]()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        assert self.session is not None
        for _ in range(2):  # a host that cannot be reached: the next one, once
            choice = await self.choose(ids, rid, skip)
            if choice is None:
                break
            worker, url, why = choice
            try:
                upstream = await self.session.request(request.method, url + tail,
                                                      headers=headers, data=body)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                log.warning("host %s unreachable (%s): the next", redact_url(url),
                            type(e).__name__)
                skip.add(worker)
                if ids:
                    await self.router.free(rid)
                continue
            return await self._relay(request, upstream, url, why, rid if ids else None)
        return self._unavailable(path)

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, url: str,
                     why: str, rid: str | None) -> web.StreamResponse:
        started = False
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            resp.headers.update({k: v for k, v in upstream.headers.items()
                                 if k.lower() not in HOP
                                 and not k.lower().startswith("access-control-")})
            resp.headers["X-Prefixgate-Upstream"] = redact_url(url)
            resp.headers["X-Prefixgate-Route"] = why
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                if rid is not None and not started:
                    started = True
                    await self.router.mark_prefill_complete(rid)
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        except (ConnectionError, aiohttp.ClientError, asyncio.TimeoutError):
            return resp  # the client or the host went away mid-answer: nothing more to say
        finally:
            upstream.release()
            if rid is not None:
                await self.router.free(rid)

    def _unavailable(self, path: str) -> web.Response:
        e = WorkerFailed("no prefixgate host can be reached through Dynamo's router: check "
                         "the hosts and their `prefixgate dynamo-worker`")
        e.status = 503
        return anthropic_response(e) if path.startswith("/v1/messages") else openai_response(e)


def make_app(front: Front) -> web.Application:
    """The front's app: its routes, below --api-prefix where one is given (the root app then
    answers nothing else, as a host's)."""
    app = web.Application(client_max_size=front.bounds.max_body_bytes)
    app[CONFIG] = front.cfg
    # the front's own policy for web pages, as serve's (a host's answer carries none of its own)
    cors.install(app, cors.Cors.of(front.cfg))
    if front.keys:
        app[ALLOWED_KEYS] = front.keys
    app.router.add_get("/health", front.health)
    app.router.add_post("/front/route", front.route)
    app.router.add_route("*", "/{tail:.*}", front.forward)
    root = app
    if front.cfg.api_prefix:
        root = web.Application(client_max_size=front.bounds.max_body_bytes)
        root.add_subapp(front.cfg.api_prefix, app)
    root.cleanup_ctx.append(front.open)
    return root


def main(argv: list[str]) -> None:
    from proxy.dynamo import need_dynamo, quiet_dynamo

    p = argparse.ArgumentParser(
        prog="prefixgate front", allow_abbrev=False,
        description="A front for several prefixgate hosts: each request goes to the host "
        "NVIDIA Dynamo's KV router picks from their KV events (docs/routing.md). Give it the "
        "hosts' model and prompt flags: it renders prompts as they do.")
    add_arguments(p)
    p.add_argument("--namespace", default="prefixgate", help="Dynamo namespace of the hosts")
    p.add_argument("--component", default="host", help="Dynamo component of the hosts")
    ns = p.parse_args(argv)
    namespace, component = ns.namespace, ns.component
    del ns.namespace, ns.component
    cfg = from_args(ns)
    from proxy.app import api_keys_of

    keys = frozenset(api_keys_of(cfg))  # auth never fails open: said before anything starts
    try:
        limits.with_overrides(cfg.limits)
    except ValueError as e:
        raise SystemExit(f"prefixgate front: {e}") from None
    need_dynamo("front")
    quiet_dynamo()
    configure_logging(cfg, "%(asctime)s %(name)s %(levelname)s %(message)s")
    web.run_app(make_app(Front(cfg, namespace, component, keys)), host=cfg.host, port=cfg.port,
                print=None, access_log=None)
