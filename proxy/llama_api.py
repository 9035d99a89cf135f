"""llama-server's own endpoints, in its shapes, for the tools and people that debug a prompt
with them (issue 21):

    POST /tokenize       {"content", "add_special"?, "with_pieces"?} -> {"tokens": [...]}
                         (with pieces: [{"id", "piece"}]); special tokens in the text are parsed
    POST /detokenize     {"tokens": [...]} -> {"content"}
    POST /apply-template a chat completion body -> {"prompt"}: the text prefixgate renders for
                         it (normalized and laid out stable first, as a request would be)
    GET  /slots          every slot of every worker: id, worker, slot, n_ctx, is_processing,
                         live_tokens, a hash of the tenant whose KV it holds, exact
    POST /slots/{id}     (save, restore, erase by file name: --slot-save-path's) a 501, as
                         llama-server answers without that option: the states are kept here
    POST /completion     llama-server's native completion: {"prompt", "n_predict" (-1: to the
                         context's end), "stream", "stop", "temperature", "top_k", "top_p",
                         "min_p", "seed", "json_schema", "grammar", llama-server's other
                         samplers (proxy/samplers.py), ...} -> {"content", "stop": true,
                         "stop_type" (eos | word | limit), "stopping_word", "tokens_predicted",
                         "tokens_evaluated", "tokens_cached", "timings", ...}; streamed as SSE
                         chunks {"content", "stop": false}, then the final object (no [DONE])
    GET  /v1/health, /models   the same as /health and /v1/models

The ids are prefixgate's own, the ones the cache keys on (equal to llama.cpp's: the tokenizer
parity tests). Each needs an API key where the APIs do; errors are OpenAI-shaped. Tokenizing and
rendering run on the gateway's render thread, never on the event loop. Every body meets the
bounds the chat APIs' bodies meet (proxy/limits.py: size, nesting, strings, arrays, messages,
tools), and text that cannot fit one slot's context whatever its tokens is refused before it is
tokenized or rendered (`PromptBuilder.check_text`), as a chat request's is.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aiohttp import web

from proxy.chat import (
    ChatRequest,
    expect_dict,
    opt_bool,
    opt_int,
    parse_grammar,
    parse_sampling,
    parse_stop,
)
from proxy.edge import (
    CONFIG,
    GATEWAY,
    LIMITS,
    MODEL_ID,
    POOL,
    cache_headers,
    check_auth,
    read_body,
    serve,
    sse_response,
    with_pings,
)
from proxy.errors import ApiError, BadRequest, NotSupported, openai_response
from proxy.gateway import tenant_id
from proxy.limits import Limits, check_request
from proxy.limits import load as load_json
from proxy.openai_api import parse_chat, raw_prompt, timings_json
from proxy.prompt import PromptBuilder
from proxy.run import Run


def tokenize(builder: PromptBuilder, body: Any, n_ctx: int) -> dict[str, Any]:
    body = expect_dict(body)
    content = body.get("content")
    if not isinstance(content, str):
        raise BadRequest("'content' must be a string", param="content")
    builder.check_text(len(content), n_ctx, "content")
    tok = builder.tok
    ids = tok.encode(content)
    if body.get("add_special") is True and tok.add_bos and tok.bos_id is not None:
        ids = [tok.bos_id, *ids]
    if body.get("with_pieces") is True:
        return {"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]}
    return {"tokens": ids}


def detokenize(builder: PromptBuilder, body: Any, n_ctx: int) -> dict[str, Any]:
    tokens = expect_dict(body).get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise BadRequest("'tokens' must be a list of token ids", param="tokens")
    try:
        return {"content": builder.tok.decode(tokens)}
    except (IndexError, KeyError, ValueError, OverflowError):
        raise BadRequest("'tokens' holds an id outside the model's vocabulary",
                         param="tokens") from None


def apply_template(builder: PromptBuilder, body: Any, n_ctx: int) -> dict[str, Any]:
    rendered, _ = builder.render(parse_chat(body, ""), n_ctx)
    return {"prompt": rendered.text}


def _load(raw: bytes, bounds: Limits) -> Any:
    """The JSON body within the bounds every API's body meets (proxy.edge.parse_body's)."""
    body = load_json(raw, bounds)
    check_request(body, bounds)
    return body


def _handler(fn: Any) -> Any:
    async def handle(request: web.Request) -> web.Response:
        check_auth(request)
        gw = request.app[GATEWAY]
        raw = await read_body(request)
        body = await gw.offload(_load, raw, request.app[LIMITS])
        return web.json_response(await gw.offload(fn, gw.prompts, body,
                                                  request.app[CONFIG].slot_ctx))
    return handle


async def slots(request: web.Request) -> web.Response:
    key = check_auth(request)
    mine = tenant_id(key) if request.app[CONFIG].tenant_isolation else None
    return web.json_response(slots_json(request.app, mine))


async def slot_action(request: web.Request) -> web.Response:
    """llama-server's POST /slots/{id}?action=save|restore|erase, which it serves with
    --slot-save-path: here every prompt's state is kept and found by its prefix, so there is
    nothing to save or restore by name (llama-server's own answer without the option)."""
    check_auth(request)
    raise NotSupported("saving, restoring and erasing slots by file name is not supported: "
                       "prefixgate keeps every prompt's state on disk itself and restores it "
                       "for any request that begins with the same tokens")


def slots_json(app: web.Application, mine: str | None = None) -> list[dict[str, Any]]:
    """/slots's body: every slot, as llama-server lists them (tools count and index them by
    id). With --tenant-isolation (`mine`: the caller's tenant) a caller sees the details of the
    slots that hold its own tenant's KV (or nothing); another tenant's slot shows only whether
    it is busy, which any client can tell from its own waiting anyway: no token count, no
    tenant."""
    cfg = app[CONFIG]
    out = []
    for i, s in enumerate(app[POOL].slots):
        slot = {"id": i, "worker": s.worker_id, "slot": s.index, "n_ctx": cfg.slot_ctx,
                "is_processing": s.busy, "ready": s.ready, "exact": s.worker.exact}
        if mine is None or s.live_tenant in ("", mine):
            slot["live_tokens"] = len(s.live_ids)
            if s.busy and s.holder is not None:  # how much of its run's prompt is in
                total, done = s.holder.progress
                slot["prompt_progress"] = {"total": total, "processed": done}  # the KV
            slot["tenant"] = hashlib.sha256(s.live_tenant.encode()).hexdigest()[:12] \
                if s.live_tenant else ""
        out.append(slot)
    return out


def parse_native(body: Any, tenant: str) -> ChatRequest:
    """A /completion body as a raw-prompt request (the prompt is used as it is: no template)."""
    body = expect_dict(body)
    prompt = raw_prompt(body, " (token-id prompts are not supported: /tokenize shows the ids "
                              "a text gets)")
    n_predict = opt_int(body, "n_predict", -1)
    if n_predict == 0:
        raise BadRequest("'n_predict': 0 (evaluate the prompt only) is not supported; give -1 "
                         "or a number of tokens", param="n_predict")
    schema = body.get("json_schema")
    if schema is not None and not isinstance(schema, dict):
        raise BadRequest("'json_schema' must be a JSON schema object", param="json_schema")
    return ChatRequest(api="completion", messages=(), prompt=prompt,
                       sampling=parse_sampling(body),
                       max_tokens=None if n_predict is None or n_predict < 0 else n_predict,
                       stop=parse_stop(body.get("stop")), stream=opt_bool(body, "stream"),
                       tenant=tenant, json_schema=schema, grammar=parse_grammar(body))


def _final(request: web.Request, req: ChatRequest, run: Run, content: str) -> dict[str, Any]:
    """llama-server's last /completion object: the text (all of it, or "" when streamed), why
    it stopped, the token counts and the timings."""
    u = run.usage
    stop_type = "limit" if run.finish_reason == "length" else "word" if run.state.stop \
        else "eos"
    cfg = request.app[CONFIG]
    return {"content": content, "id_slot": 0, "stop": True, "model": request.app[MODEL_ID],
            "tokens_predicted": u.completion_tokens, "tokens_evaluated": u.prompt_tokens,
            "tokens_cached": u.cached_tokens, "prompt": req.prompt, "truncated": False,
            "has_new_line": "\n" in content, "stop_type": stop_type,
            "stopping_word": run.state.stop or "",
            # what the run used: the request's settings over the server's defaults
            "generation_settings": {"n_ctx": cfg.slot_ctx,
                                    "n_predict": run.prep.req.max_tokens or -1,
                                    "stop": list(req.stop), **run.prep.req.sampling,
                                    "speculative.types": cfg.spec_type},
            "timings": timings_json(run)}


async def _respond_native(request: web.Request, req: ChatRequest, run: Run
                          ) -> web.StreamResponse:
    if not req.stream:
        text = "".join([piece async for piece in run.pieces()])
        return web.json_response(_final(request, req, run, text), headers=cache_headers(run))
    resp = await sse_response(request, cache_headers(run))

    async def keepalive() -> None:  # an SSE comment during a long prefill
        await resp.write(b": keepalive\n\n")

    def chunk(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    try:
        async for piece in with_pings(run.pieces(), request.app[CONFIG].ping_interval_s,
                                      keepalive):
            await resp.write(chunk({"content": piece, "stop": False, "id_slot": 0,
                                    "index": 0}))
    except ApiError as e:
        await resp.write(chunk({"error": {"code": e.status, "message": e.message,
                                          "type": e.kind}}))
        return resp
    await resp.write(chunk(_final(request, req, run, "")))
    await resp.write_eof()
    return resp


async def completion(request: web.Request) -> web.StreamResponse:
    return await serve(request, "completion", parse_native, openai_response, _respond_native)


def add_routes(app: web.Application, health: Any, models: Any) -> None:
    app.router.add_get("/slots", slots)
    app.router.add_post("/slots/{id_slot}", slot_action)
    app.router.add_post("/completion", completion)
    app.router.add_post("/completions", completion)
    app.router.add_post("/tokenize", _handler(tokenize))
    app.router.add_post("/detokenize", _handler(detokenize))
    app.router.add_post("/apply-template", _handler(apply_template))
    app.router.add_get("/v1/health", health)
    app.router.add_get("/models", models)
