"""OpenAI API edge: POST /v1/chat/completions (and /chat/completions), POST /v1/completions,
GET /v1/models. Parse into ChatRequest, render responses (JSON or SSE chunks). Errors use
OpenAI's shape `{"error": {message, type, param, code}}`. The handler skeleton is proxy/edge.py's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from itertools import chain
from operator import itemgetter
from typing import Any

from aiohttp import web

from proxy import limits
from proxy import tools as tools_mod
from proxy.chat import (
    ROLES,
    ChatRequest,
    expect_dict,
    opt_bool,
    opt_int,
    parse_grammar,
    parse_prefix_cache,
    parse_sampling,
    parse_stop,
    placeholder,
)
from proxy.defaults import inline_reasoning
from proxy.dialects import (
    ArgsDelta,
    CallDone,
    CallOpen,
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    events,
)
from proxy.edge import (
    CONFIG,
    GATEWAY,
    MODEL_ID,
    cache_headers,
    client_gone,
    model_card,
    serve,
    sse_response,
    with_pings,
)
from proxy.errors import ApiError, BadRequest, openai_response
from proxy.memo import IdMemo, PrefixMemo
from proxy.run import Run
from proxy.run_state import Usage
from proxy.speculation import totals

# OpenAI part types that carry media, and the kind each is (proxy.chat.placeholder)
MEDIA_PARTS = {"image_url": "image", "image": "image", "input_image": "image",
               "input_audio": "audio", "file": "file", "input_file": "file"}
TEXT_PARTS = {"text": "text"}  # part type -> its key holding the text (Chat Completions)


def content_text(content: Any, where: str, texts: dict[str, str] = TEXT_PARTS
                 ) -> tuple[str, tuple[str, ...]]:
    """Message content as the template sees it: a string (text parts joined as they are, a
    media part's placeholder on a line of its own), and the kinds of media replaced."""
    if content is None:
        return "", ()
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text parts", param=where)
    pieces: list[tuple[bool, str]] = []  # (a placeholder, its text)
    kinds: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise BadRequest(f"{where} parts must be objects with a 'type'", param=where)
        if kind in texts and isinstance(part.get(texts[kind]), str):
            pieces.append((False, part[texts[kind]]))
        elif kind in MEDIA_PARTS:
            kinds.append(MEDIA_PARTS[kind])
            pieces.append((True, placeholder(MEDIA_PARTS[kind])))
        else:
            raise BadRequest(f"{where} part of type '{kind}' is not supported; send "
                             f"{' or '.join(sorted(texts))} parts", param=where)
    out = []
    for k, (media, text) in enumerate(pieces):
        if k and (media or pieces[k - 1][0]):
            out.append("\n")
        out.append(text)
    return "".join(out), tuple(kinds)


def parse_messages(raw: Any) -> tuple[tuple[dict[str, Any], ...], tuple[str, ...]]:
    """(the messages, the kinds of media replaced by a placeholder in them)."""
    if raw is None:
        raise BadRequest("'messages' is required: a non-empty list of {role, content}",
                         param="messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list of {role, content}",
                         param="messages")
    done = _HISTORIES.carried(raw, _PARSED, lambda i, m: _message(m, i))
    return tuple(map(itemgetter(0), done)), tuple(chain.from_iterable(map(itemgetter(1), done)))


def _message(m: Any, i: int) -> tuple[dict[str, Any], tuple[str, ...]]:
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'",
                         param=f"messages[{i}]")
    role = m.get("role")
    if role not in ROLES:
        raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}; "
                         f"got {role!r}", param=f"messages[{i}].role")
    content, media = content_text(m.get("content"), f"messages[{i}].content")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": content}
    if role == "assistant" and m.get("tool_calls"):
        msg["tool_calls"] = parse_tool_calls(m["tool_calls"], i)
    reasoning = m.get("reasoning_content", m.get("reasoning")) if role == "assistant" \
        else None
    if isinstance(reasoning, str) and reasoning:
        msg["reasoning_content"] = reasoning
    if role == "tool":
        msg["tool_call_id"] = str(m.get("tool_call_id", ""))
    if isinstance(m.get("name"), str):
        msg["name"] = m["name"]
    return msg, media


_PARSED = IdMemo()  # a body's message -> what parse_messages made of it; its tools likewise
_HISTORIES = PrefixMemo()  # a body's messages -> what parse_messages made of each


def parse_tool_calls(raw: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list", param="tool_calls")
    calls = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"messages[{i}].tool_calls entries need function.name",
                             param="tool_calls")
        args = fn.get("arguments", "{}")
        try:  # JSON inside a string: the same bounds as the body's
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            parsed = limits.parse(args, where=where) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        calls.append({"id": c.get("id", ""), "type": "function",
                      "function": {"name": fn["name"], "arguments": parsed}})
    return calls


def parse_tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    parsed: tuple[dict[str, Any], ...] | None = _PARSED.get(raw)
    if parsed is not None:  # the same tools as in a recent body (proxy/memo.py)
        return parsed
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be a list of {type: function, function: {...}}",
                         param="tools")
    tools = []
    for t in raw:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest("each tool must be {type: 'function', function: {name, "
                             "description, parameters}}", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object",
                             param="tools")
        tools.append({"type": "function", "function": fn})
    return _PARSED.put(raw, tuple(tools))


def parse_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs` (llama-server's and vLLM's: e.g. {"enable_thinking": false}) and
    `reasoning_effort` (gpt-oss reads it), as variables for the chat template."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object of template variables, "
                         'e.g. {"enable_thinking": false}', param="chat_template_kwargs")
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & \
        set(kwargs)
    if reserved:
        raise BadRequest(f"'chat_template_kwargs' cannot set {', '.join(sorted(reserved))}: "
                         "prefixgate sets them from the request", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:  # none | minimal | low | medium | high | ...: the template decides
        if not isinstance(effort, str):
            raise BadRequest("'reasoning_effort' must be a string such as low, medium or high",
                             param="reasoning_effort")
        kwargs = {"reasoning_effort": effort, **kwargs}
    return kwargs


def _common(body: dict[str, Any], tenant: str) -> dict[str, Any]:
    max_tokens = opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", 1)
    stream = opt_bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    scope, window = parse_prefix_cache(body)
    return {
        "sampling": parse_sampling(body),
        "max_tokens": max_tokens,
        "stop": parse_stop(body.get("stop")),
        "stream": stream,
        "include_usage": bool(so and so.get("include_usage")),
        "scope": scope,
        "window": window,
        "tenant": tenant,
    }


def parse_chat(body: Any, tenant: str) -> ChatRequest:
    body = expect_dict(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    messages, media = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    return ChatRequest(api="openai", messages=messages, media=media, tools=tools,
                       tool_choice=tools_mod.parse_choice(body.get("tool_choice"), tools),
                       template_kwargs=parse_template_kwargs(body),
                       json_schema=parse_response_format(body.get("response_format")),
                       grammar=parse_grammar(body), **_common(body, tenant))


def parse_response_format(raw: Any) -> Any:
    """OpenAI's response_format: text (None), json_object (any object: {"type": "object"}) or
    json_schema (its schema); the grammar is built and checked when the prompt is rendered."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise BadRequest("'response_format' must be {type: text | json_object | json_schema}",
                         param="response_format")
    if raw["type"] == "text":
        return None
    if raw["type"] == "json_object":
        return {"type": "object"}
    spec = raw.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object",
                         param="response_format")
    return schema


def raw_prompt(body: dict[str, Any], why: str = "") -> str:
    """A completion's `prompt`: a non-empty string, or a list of one (`why`: said after the
    error where the API has more to say)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string" + why, param="prompt")
    return prompt


def parse_completion(body: Any, tenant: str) -> ChatRequest:
    body = expect_dict(body)
    return ChatRequest(api="completions", messages=(), prompt=raw_prompt(body),
                       grammar=parse_grammar(body), **_common(body, tenant))


def usage_json(u: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def reasoning_tokens(decode: Callable[[list[int]], str], ids: list[int], end: str) -> int:
    """How many of the generated `ids` are reasoning: those up to the first whose text closes
    it (`end`: "</think>", Harmony's "<|end|>"), all of them when it never closed; a binary
    search over prefixes, a few decodes."""
    if end not in decode(ids):
        return len(ids)
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds `end`
    while lo < hi:
        mid = (lo + hi) // 2
        if end in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def timings_json(run: Run) -> dict[str, Any]:
    """llama-server's `timings`: prompt tokens computed (`prompt_n`) and reused (`cache_n`),
    generated (`predicted_n`), and the milliseconds each took; draft tokens verified and
    accepted (`draft_n`, `draft_n_accepted`) where it drafted."""
    u, t = run.usage, run.timings
    prompt_ms, predicted_ms = 1000 * t.get("prefill_s", 0.0), 1000 * t.get("decode_s", 0.0)
    prompt_n = u.prompt_tokens - u.cached_tokens
    out = {"cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
           "prompt_per_second": round(prompt_n / prompt_ms * 1000, 2) if prompt_ms else 0.0,
           "predicted_n": u.completion_tokens, "predicted_ms": round(predicted_ms, 3),
           "predicted_per_second": round(u.completion_tokens / predicted_ms * 1000, 2)
           if predicted_ms else 0.0}
    drafted, accepted = totals(run.state.draft)
    if drafted:  # as llama-server: only an answer that drafted
        out.update(draft_n=drafted, draft_n_accepted=accepted)
    return out


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": "call_" + call.id_hex, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


class Responder:
    """Renders one run as a chat.completion or text_completion, JSON or SSE. Reasoning goes
    in `reasoning_content` (llama-server's and vLLM's field), in messages and in deltas."""

    def __init__(self, req: ChatRequest, run: Run, model_id: str, chat: bool,
                 decode: Callable[[list[int]], str], reasoning_format: str = "auto") -> None:
        self.req, self.run, self.model, self.chat = req, run, model_id, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.n_calls = 0
        self.reasoned = False  # a ReasoningDelta came: usage counts its tokens
        self.decode = decode
        self.reasoning_format = reasoning_format  # --reasoning-format (proxy/defaults.py)

    def _usage(self) -> dict[str, Any]:
        n = 0
        dialect = self.run.prep.dialect
        if self.reasoned and dialect is not None:
            end = dialect.think[1] if dialect.think else "<|end|>"
            n = reasoning_tokens(self.decode, self.run.state.gen_ids, end)
        return usage_json(self.run.usage, n)

    def _events(self) -> AsyncIterator[Event]:
        dialect = self.run.prep.dialect
        return inline_reasoning(
            events(self.run.pieces(), self.run.prep.stream() if self.chat else None),
            self.reasoning_format, dialect.think if dialect is not None else None)

    def _finish(self) -> str:
        # a call that max_tokens cut is still a call (with the arguments that completed), and
        # the answer says "length", as OpenAI's does
        return "tool_calls" if self.n_calls and self.run.finish_reason != "length" \
            else self.run.finish_reason

    def _choice(self, text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body: dict[str, Any] = {"role": "assistant", "content": text} if not delta else \
            ({"content": text} if text is not None else {})
        key = "delta" if delta else "message"
        return {"index": 0, key: body, "logprobs": None, "finish_reason": finish}

    async def json(self, request: web.Request) -> web.Response:
        parts: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        async for ev in self._events():
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
            elif isinstance(ev, ReasoningDelta):
                reasoning.append(ev.text)
                self.reasoned = True
            elif isinstance(ev, CallDone):
                calls.append(ev.call)
        self.n_calls = len(calls)
        text = "".join(parts)
        choice = self._choice(text if text or not calls else None, self._finish(), False)
        if reasoning:
            choice["message"]["reasoning_content"] = "".join(reasoning)
        if calls:
            choice["message"]["tool_calls"] = [_call_json(c) for c in calls]
        body = {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [choice], "usage": self._usage(),
                "timings": timings_json(self.run)}
        return web.json_response(body, headers=cache_headers(self.run))

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
               timings: dict[str, Any] | None = None) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created,
                                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        if timings is not None:
            body["timings"] = timings
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": None}])

    def _event_chunk(self, ev: Event) -> bytes | None:
        """One event as OpenAI streams it: a call's id and name with empty arguments first,
        then its arguments as they complete."""
        if isinstance(ev, TextDelta):
            return self._chunk([self._choice(ev.text, None, True)])
        if isinstance(ev, ReasoningDelta):
            self.reasoned = True
            return self._delta({"reasoning_content": ev.text})
        if isinstance(ev, CallOpen):
            return self._delta({"tool_calls": [{
                "index": ev.index, "id": "call_" + ev.id_hex, "type": "function",
                "function": {"name": ev.name, "arguments": ""}}]})
        if isinstance(ev, ArgsDelta):
            return self._delta({"tool_calls": [{"index": ev.index,
                                                "function": {"arguments": ev.json}}]})
        self.n_calls += 1  # CallDone: all of it is out already
        return None

    async def stream(self, request: web.Request, include_usage: bool, ping_s: float
                     ) -> web.StreamResponse:
        """The SSE chunks; while none is due (a long prefill) an SSE comment every ping_s, so a
        reverse proxy with an idle timeout does not cut the stream."""
        resp = await sse_response(request, cache_headers(self.run))
        if self.chat:
            await resp.write(self._delta({"role": "assistant", "content": ""}))

        async def keepalive() -> None:  # an SSE comment: clients skip it, proxies see traffic
            await resp.write(b": keepalive\n\n")

        try:
            async for ev in with_pings(self._events(), ping_s, keepalive):
                chunk = self._event_chunk(ev)
                if chunk is not None:
                    await resp.write(chunk)
        except ApiError as e:
            if client_gone(request):
                return resp  # the client left; its run was cancelled, nobody to tell
            err = {"error": {"message": e.message, "type": e.kind, "param": None, "code": e.code}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            return resp
        last = self._chunk([self._choice(None if self.chat else "", self._finish(), True)],
                           timings=timings_json(self.run))
        await resp.write(last)
        if include_usage:
            await resp.write(self._chunk([], self._usage()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


# --- handlers ------------------------------------------------------------------------------


def _respond(chat: bool) -> Callable[[web.Request, ChatRequest, Run],
                                    Awaitable[web.StreamResponse]]:
    async def respond(request: web.Request, req: ChatRequest, run: Run) -> web.StreamResponse:
        gw = request.app[GATEWAY]
        r = Responder(req, run, request.app[MODEL_ID], chat, gw.prompts.tok.decode,
                      gw.defaults.reasoning_format)
        return await (r.stream(request, req.include_usage, request.app[CONFIG].ping_interval_s)
                      if req.stream else r.json(request))

    return respond


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, "openai", parse_chat, openai_response, _respond(chat=True))


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, "completions", parse_completion, openai_response,
                       _respond(chat=False))


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(request.app)]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
