"""OpenAI Responses API edge: POST /v1/responses (Codex CLI's API), on the same preparation,
cache and run as chat completions (proxy/edge.py's handler skeleton). Errors use OpenAI's shape.

Parsing into the internal, OpenAI-shaped messages:
- `instructions` is the system message, first. `input` is a string (one user message) or a
  list of items: messages (`role` user, assistant, system or developer, with or without
  `type: "message"`; `content` a string or parts: `input_text`, `output_text`, `refusal`;
  `input_image` and `input_file` become a placeholder, proxy.chat), `function_call` (a call of
  the assistant turn it follows; its `arguments` a JSON string), `function_call_output` (a
  `role: "tool"` message named after its call), and `reasoning` (its `content` text, else its
  `summary` text, is the next assistant turn's reasoning). Other item types are a 400.
- `tools`: function tools `{type: function, name, description, parameters}`, and `namespace`
  tools, groups of function tools (Codex sends its sub-agent tools as one): the model sees each
  function among the others, under its own name (`NAMESPACE__NAME` where another tool has that
  name), and its call is a `function_call` with the `namespace` (as in the history Codex sends
  back). Other types (web_search, local_shell, custom, ...) are ignored with a log line (once
  per type): prefixgate cannot run them. `tool_choice`: auto | none | required |
  {type: function, name}.
- `max_output_tokens`, `temperature`, `top_p` (and llama-server's other sampling fields),
  `stream`, `reasoning.effort` (the template's `reasoning_effort`), `chat_template_kwargs`,
  `prefix_cache`, `text.format` (json_object / json_schema: a grammar). `store`, `include`,
  `parallel_tool_calls`, `prompt_cache_key`, `metadata`, `truncation`, `user`, `service_tier`
  are accepted and ignored. `previous_response_id` is a 400: nothing is stored, the client
  sends the whole conversation (Codex does).

The answer is a `response`: its `output` the items in the order the model wrote them, a
`reasoning` item (its text as one `reasoning_text` part), a `message` (one `output_text` part)
and a `function_call` per call; `status` completed, or incomplete (`max_output_tokens`) where
the length cut it. Streamed, the Responses event sequence, each with its `sequence_number`:
`response.created`, `response.in_progress`, then per item `response.output_item.added`, its
content part's `response.content_part.added`, the `response.output_text.delta` /
`response.reasoning_text.delta` (or `response.function_call_arguments.delta`), their `.done`,
`response.content_part.done`, `response.output_item.done`; last `response.completed` (or
`response.incomplete`). A failure after the stream started is an `error` event.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from proxy import limits
from proxy import tools as tools_mod
from proxy.chat import (
    ChatRequest,
    expect_dict,
    opt_bool,
    opt_int,
    parse_prefix_cache,
    parse_sampling,
)
from proxy.dialects import ArgsDelta, CallDone, CallOpen, Event, ReasoningDelta, TextDelta, events
from proxy.edge import (
    CONFIG,
    GATEWAY,
    MODEL_ID,
    cache_headers,
    client_gone,
    serve,
    sse_response,
    with_pings,
)
from proxy.errors import ApiError, BadRequest, openai_response
from proxy.openai_api import content_text, parse_template_kwargs, reasoning_tokens
from proxy.run import Run

log = logging.getLogger("prefixgate")

# input part type -> the key holding its text
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
ROLES = ("user", "assistant", "system", "developer")
_IGNORED: set[str] = set()  # the tool types a log line has said are ignored


# --- parsing -------------------------------------------------------------------------------


class _Input:
    """Accumulates OpenAI-shaped messages from Responses input items."""

    def __init__(self, instructions: str, spaces: dict[str, tuple[str, str]]) -> None:
        self.out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] \
            if instructions else []
        self.media: list[str] = []
        self.reasoning = ""  # a reasoning item's text, for the next assistant turn
        self.names: dict[str, str] = {}  # call_id -> function name
        # (namespace, name) -> the name the model sees (a `namespace` tool's functions)
        self.flat = {where: name for name, where in spaces.items()}

    def add(self, item: Any, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object (a message or an item with a 'type')",
                             param=where)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            self._output(item, where)
        elif kind == "reasoning":
            self.reasoning = _reasoning_text(item, where)
        else:
            raise BadRequest(f"{where}: items of type {kind!r} are not supported; send "
                             "messages, function_call, function_call_output and reasoning "
                             "items", param=where)

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}",
                             param=f"{where}.role")
        text, media = content_text(item.get("content"), f"{where}.content", TEXT_PARTS)
        self.media += media
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": text}
        if role == "assistant" and self.reasoning:
            msg["reasoning_content"], self.reasoning = self.reasoning, ""
        self.out.append(msg)

    def _call(self, item: dict[str, Any], where: str) -> None:
        name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
        if not isinstance(name, str) or not isinstance(args, str) or \
                not isinstance(call_id, str):
            raise BadRequest(f"{where}: a function_call needs 'call_id', 'name' and "
                             "'arguments' (a JSON string)", param=where)
        try:  # JSON inside a string: the same bounds as the body's
            parsed: Any = limits.parse(args, where=f"{where}.arguments")
        except json.JSONDecodeError:
            parsed = args
        space = item.get("namespace")
        if isinstance(space, str) and space:
            name = self.flat.get((space, name), name)
        self.names[call_id] = name
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
        last = self.out[-1] if self.out else None
        if last is not None and last["role"] == "assistant" and not self.reasoning:
            self.out[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
            return
        msg: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        if self.reasoning:
            msg["reasoning_content"], self.reasoning = self.reasoning, ""
        self.out.append(msg)

    def _output(self, item: dict[str, Any], where: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise BadRequest(f"{where}: a function_call_output needs its 'call_id'",
                             param=where)
        text, media = content_text(item.get("output"), f"{where}.output", TEXT_PARTS)
        self.media += media
        msg = {"role": "tool", "tool_call_id": call_id, "content": text}
        if call_id in self.names:
            msg["name"] = self.names[call_id]
        self.out.append(msg)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its `content` (reasoning_text parts), else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
            raise BadRequest(f"{where}.{key} must be a list of {{type, text}} parts",
                             param=f"{where}.{key}")
        if parts:
            return "\n\n".join(p["text"] for p in parts)
    return ""


def parse_tools(raw: Any) -> tuple[tuple[dict[str, Any], ...], dict[str, tuple[str, str]]]:
    """(the function tools the model sees, the namespace each one of a `namespace` tool came
    in: the name the model sees -> (namespace, its name there))."""
    if raw is None:
        return (), {}
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be a list of {type: function, name, parameters}",
                         param="tools")
    tools: list[dict[str, Any]] = []
    spaces: dict[str, tuple[str, str]] = {}
    grouped: list[tuple[str, str, dict[str, Any]]] = []  # (namespace, where, tool)
    for k, t in enumerate(raw):
        if not isinstance(t, dict):
            raise BadRequest(f"tools[{k}] must be an object", param=f"tools[{k}]")
        if t.get("type") == "namespace":
            name, inner = t.get("name"), t.get("tools")
            if not isinstance(name, str) or not name or not isinstance(inner, list):
                raise BadRequest(f"tools[{k}]: a namespace tool needs a 'name' and its 'tools'",
                                 param=f"tools[{k}]")
            grouped += [(name, f"tools[{k}].tools[{j}]", u) for j, u in enumerate(inner)]
        elif (fn := _function(t, f"tools[{k}]")) is not None:
            tools.append({"type": "function", "function": fn})
    taken = {t["function"]["name"] for t in tools}
    for space, where, t in grouped:
        fn = _function(t, where)
        if fn is None:
            continue
        name = fn["name"]
        if name in taken:  # the model tells them apart by name alone
            fn["name"] = f"{space}__{name}"
        taken.add(fn["name"])
        spaces[fn["name"]] = (space, name)
        tools.append({"type": "function", "function": fn})
    return tuple(tools), spaces


def _function(t: Any, where: str) -> dict[str, Any] | None:
    """A function tool as chat completions' `function`; None (and a log line) for a tool of
    another type."""
    if not isinstance(t, dict):
        raise BadRequest(f"{where} must be an object", param=where)
    if t.get("type") != "function":  # said once per type: Codex sends its web_search each turn
        kind = str(t.get("type"))[:64]
        (log.debug if kind in _IGNORED or len(_IGNORED) > 64 else log.info)(
            "responses: ignoring tools of type %r: prefixgate cannot run them", kind)
        _IGNORED.add(kind)
        return None
    if not isinstance(t.get("name"), str):
        raise BadRequest(f"{where} needs a 'name'", param=where)
    if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
        raise BadRequest(f"tool {t['name']!r}: 'parameters' must be a JSON schema object",
                         param=f"{where}.parameters")
    fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
    if isinstance(t.get("description"), str):
        fn["description"] = t["description"]
    return fn


def parse_choice(raw: Any, tools: tuple[dict[str, Any], ...]) -> Any:
    if raw is None or raw in ("auto", "none", "required"):
        choice: Any = raw or "auto"
    elif isinstance(raw, dict) and raw.get("type") == "function" and \
            isinstance(raw.get("name"), str):
        choice = {"name": raw["name"]}
    else:
        raise BadRequest("'tool_choice' must be auto, none, required or "
                         '{"type": "function", "name": ...}', param="tool_choice")
    return tools_mod.check_choice(choice, tools, "tool_choice")


def parse_format(text: Any) -> Any:
    """`text.format` as the JSON schema the answer must match (None: free text)."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and \
            isinstance(fmt.get("schema"), dict):
        return fmt["schema"]
    raise BadRequest("'text.format' must be {type: text | json_object} or {type: json_schema, "
                     "schema: {...}}", param="text.format")


def parse_request(body: Any, tenant: str) -> ChatRequest:
    body = expect_dict(body)
    if body.get("previous_response_id") is not None:
        raise BadRequest("'previous_response_id': prefixgate stores no responses; send the "
                         "whole conversation in 'input'", param="previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'input' is required: a string or a non-empty list of items",
                         param="input")
    tools, spaces = parse_tools(body.get("tools"))
    b = _Input(instructions or "", spaces)
    for i, item in enumerate(raw):
        b.add(item, i)
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    scope, window = parse_prefix_cache(body)
    return ChatRequest(
        api="responses", messages=tuple(b.out), media=tuple(b.media), tools=tools,
        tool_choice=parse_choice(body.get("tool_choice"), tools),
        sampling=parse_sampling(body), max_tokens=opt_int(body, "max_output_tokens", 1),
        stream=opt_bool(body, "stream"), scope=scope, window=window, tenant=tenant,
        template_kwargs=parse_template_kwargs({
            "chat_template_kwargs": body.get("chat_template_kwargs"),
            "reasoning_effort": effort}),
        json_schema=parse_format(body.get("text")), namespaces=spaces)


# --- responses -----------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class _Items:
    """Events as output items: an item opens when the kind of output changes (reasoning, a
    message, a function call) and is done before the next opens. `event` returns the stream
    events it makes, as (type, fields); `output` is every item so far, as it ends."""

    def __init__(self, spaces: dict[str, tuple[str, str]]) -> None:
        self.spaces = spaces  # ChatRequest.namespaces
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text: list[str] = []  # the open item's text (or arguments) so far

    def event(self, ev: Event) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(ev, TextDelta | ReasoningDelta):
            kind = "message" if isinstance(ev, TextDelta) else "reasoning"
            out = [] if self.open is not None and self.open["type"] == kind else \
                self.close() + self._start(kind)
            self.text.append(ev.text)
            name = "output_text" if kind == "message" else "reasoning_text"
            delta = {**self._where(), "content_index": 0, "delta": ev.text}
            return [*out, (f"response.{name}.delta",
                           {**delta, "logprobs": []} if kind == "message" else delta)]
        if isinstance(ev, CallOpen):
            return self.close() + self._start("function_call", "call_" + ev.id_hex, ev.name)
        if isinstance(ev, ArgsDelta):
            self.text.append(ev.json)
            return [("response.function_call_arguments.delta", {**self._where(),
                                                                "delta": ev.json})]
        assert isinstance(ev, CallDone)
        if not self.text:  # a call whose arguments never streamed: all of them now
            self.text.append(ev.call.arguments_json)
        return self.close()

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _start(self, kind: str, call_id: str = "", name: str = ""
               ) -> list[tuple[str, dict[str, Any]]]:
        self.text = []
        if kind == "function_call":
            self.open = {"id": _id("fc_"), "type": kind, "status": "in_progress",
                         "call_id": call_id, "name": name, "arguments": ""}
            if name in self.spaces:  # a function of a namespace tool: named as it was given
                self.open["namespace"], self.open["name"] = self.spaces[name]
            return [("response.output_item.added", {"output_index": len(self.output),
                                                    "item": dict(self.open)})]
        self.open = {"id": _id("msg_"), "type": kind, "status": "in_progress",
                     "role": "assistant", "content": []} if kind == "message" else \
            {"id": _id("rs_"), "type": kind, "status": "in_progress", "summary": [],
             "content": []}
        return [("response.output_item.added", {"output_index": len(self.output),
                                                "item": dict(self.open)}),
                ("response.content_part.added", {**self._where(), "content_index": 0,
                                                 "part": _part(kind, "")})]

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        item, text, where = self.open, "".join(self.text), self._where()
        self.open, self.text = None, []
        item["status"] = "completed"
        if item["type"] == "function_call":
            item["arguments"] = text
            out = [("response.function_call_arguments.done",
                    {**where, "name": item["name"], "arguments": text})]
        else:
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            done = {**where, "content_index": 0, "text": text}
            item["content"] = [_part(item["type"], text)]
            out = [(f"response.{name}.done",
                    {**done, "logprobs": []} if item["type"] == "message" else done),
                   ("response.content_part.done", {**where, "content_index": 0,
                                                   "part": _part(item["type"], text)})]
        self.output.append(item)
        return [*out, ("response.output_item.done", {"output_index": where["output_index"],
                                                     "item": item})]


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "reasoning_text", "text": text}


class Responder:
    """Renders one run as a Responses `response`, JSON or SSE."""

    def __init__(self, req: ChatRequest, run: Run, model_id: str,
                 decode: Callable[[list[int]], str]) -> None:
        self.req, self.run, self.model, self.decode = req, run, model_id, decode
        self.id = _id("resp_")
        self.created = int(time.time())
        self.items = _Items(req.namespaces)
        self.seq = 0

    def _events(self) -> AsyncIterator[Event]:
        return events(self.run.pieces(), self.run.prep.stream())

    def _usage(self) -> dict[str, Any]:
        u, dialect, n = self.run.usage, self.run.prep.dialect, 0
        if dialect is not None and any(i["type"] == "reasoning" for i in self.items.output):
            end = dialect.think[1] if dialect.think else "<|end|>"
            n = reasoning_tokens(self.decode, self.run.state.gen_ids, end)
        return {"input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                         "cache_write_tokens": u.created_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": n},
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    def response(self, status: str) -> dict[str, Any]:
        req, done = self.req, status != "in_progress"
        choice = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "name": req.tool_choice["name"]}
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": self.items.output if done else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": None, "metadata": {}, "parallel_tool_calls": True,
            "temperature": req.sampling.get("temperature"), "top_p": req.sampling.get("top_p"),
            "tool_choice": choice,
            "tools": [{"type": "function", "strict": False, **t["function"]}
                      for t in req.tools],
            "max_output_tokens": req.max_tokens, "previous_response_id": None,
            "reasoning": {"effort": req.template_kwargs.get("reasoning_effort")},
            "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": self._usage() if done else None,
        }

    def _status(self) -> str:
        return "incomplete" if self.run.finish_reason == "length" else "completed"

    async def json(self, request: web.Request) -> web.Response:
        async for ev in self._events():
            self.items.event(ev)
        self.items.close()
        return web.json_response(self.response(self._status()),
                                 headers=cache_headers(self.run))

    def _sse(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    async def stream(self, request: web.Request, ping_s: float) -> web.StreamResponse:
        """The Responses event sequence; while none is due (a long prefill) an SSE comment
        every ping_s, so a reverse proxy with an idle timeout does not cut the stream."""
        resp = await sse_response(request, cache_headers(self.run))

        async def keepalive() -> None:
            await resp.write(b": keepalive\n\n")

        await resp.write(self._sse("response.created", {"response": self.response(
            "in_progress")}))
        await resp.write(self._sse("response.in_progress", {"response": self.response(
            "in_progress")}))
        try:
            async for ev in with_pings(self._events(), ping_s, keepalive):
                for kind, fields in self.items.event(ev):
                    await resp.write(self._sse(kind, fields))
        except ApiError as e:
            if client_gone(request):
                return resp  # the client left; its run was cancelled, nobody to tell
            log.warning("responses stream failed after the response started: %s", e.message)
            await resp.write(self._sse("error", {"code": e.code or e.kind,
                                                 "message": e.message, "param": None}))
            return resp
        for kind, fields in self.items.close():
            await resp.write(self._sse(kind, fields))
        status = self._status()
        await resp.write(self._sse(f"response.{status}", {"response": self.response(status)}))
        await resp.write_eof()
        return resp


# --- handlers ------------------------------------------------------------------------------


async def _respond(request: web.Request, req: ChatRequest, run: Run) -> web.StreamResponse:
    r = Responder(req, run, request.app[MODEL_ID], request.app[GATEWAY].prompts.tok.decode)
    if req.stream:
        return await r.stream(request, request.app[CONFIG].ping_interval_s)
    return await r.json(request)


async def responses(request: web.Request) -> web.StreamResponse:
    return await serve(request, "responses", parse_request, openai_response, _respond)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/responses", responses)
