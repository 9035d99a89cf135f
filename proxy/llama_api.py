"""llama-server's own endpoints, in its shapes, for the tools and people that debug a prompt
with them (issue 21):

    POST /tokenize       {"content", "add_special"?, "with_pieces"?} -> {"tokens": [...]}
                         (with pieces: [{"id", "piece"}]); special tokens in the text are parsed
    POST /detokenize     {"tokens": [...]} -> {"content"}
    POST /apply-template a chat completion body -> {"prompt"}: the text prefixgate renders for
                         it (normalized and laid out stable first, as a request would be)
    GET  /slots          every slot of every worker: id, worker, slot, n_ctx, is_processing,
                         live_tokens, a hash of the tenant whose KV it holds, exact
    GET  /v1/health, /models   the same as /health and /v1/models

The ids are prefixgate's own, the ones the cache keys on (equal to llama.cpp's: the tokenizer
parity tests). Each needs an API key where the APIs do; errors are OpenAI-shaped. Tokenizing and
rendering run on the gateway's render thread, never on the event loop.
"""

from __future__ import annotations

import hashlib
from typing import Any

from aiohttp import web

from proxy.chat import expect_dict
from proxy.edge import CONFIG, GATEWAY, LIMITS, POOL, check_auth, read_body
from proxy.errors import BadRequest
from proxy.limits import load as load_json
from proxy.openai_api import parse_chat
from proxy.prompt import PromptBuilder


def tokenize(builder: PromptBuilder, body: Any) -> dict[str, Any]:
    body = expect_dict(body)
    content = body.get("content")
    if not isinstance(content, str):
        raise BadRequest("'content' must be a string", param="content")
    tok = builder.tok
    ids = tok.encode(content)
    if body.get("add_special") is True and tok.add_bos and tok.bos_id is not None:
        ids = [tok.bos_id, *ids]
    if body.get("with_pieces") is True:
        return {"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]}
    return {"tokens": ids}


def detokenize(builder: PromptBuilder, body: Any) -> dict[str, Any]:
    tokens = expect_dict(body).get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise BadRequest("'tokens' must be a list of token ids", param="tokens")
    try:
        return {"content": builder.tok.decode(tokens)}
    except (IndexError, KeyError, ValueError, OverflowError):
        raise BadRequest("'tokens' holds an id outside the model's vocabulary",
                         param="tokens") from None


def apply_template(builder: PromptBuilder, body: Any) -> dict[str, Any]:
    rendered, _ = builder.render(parse_chat(body, ""))
    return {"prompt": rendered.text}


def _handler(fn: Any) -> Any:
    async def handle(request: web.Request) -> web.Response:
        check_auth(request)
        gw = request.app[GATEWAY]
        raw = await read_body(request)
        body = await gw.offload(load_json, raw, request.app[LIMITS])
        return web.json_response(await gw.offload(fn, gw.prompts, body))
    return handle


async def slots(request: web.Request) -> web.Response:
    check_auth(request)
    cfg = request.app[CONFIG]
    return web.json_response([
        {"id": i, "worker": s.worker_id, "slot": s.index, "n_ctx": cfg.slot_ctx,
         "is_processing": s.busy, "ready": s.ready, "live_tokens": len(s.live_ids),
         "exact": s.worker.exact,
         "tenant": hashlib.sha256(s.live_tenant.encode()).hexdigest()[:12]
         if s.live_tenant else ""}
        for i, s in enumerate(request.app[POOL].slots)])


def add_routes(app: web.Application, health: Any, models: Any) -> None:
    app.router.add_get("/slots", slots)
    app.router.add_post("/tokenize", _handler(tokenize))
    app.router.add_post("/detokenize", _handler(detokenize))
    app.router.add_post("/apply-template", _handler(apply_template))
    app.router.add_get("/v1/health", health)
    app.router.add_get("/models", models)
