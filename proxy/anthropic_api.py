"""Anthropic Messages API edge: POST /v1/messages, POST /v1/messages/count_tokens.

Routes match on the path alone (Claude Code adds `?beta=true`). Unknown headers and body fields
are ignored (`anthropic-beta`, `metadata`, `context_management`, `output_config`,
`cache_control` on any block, `$schema` in tool schemas). `thinking` ({"type": "enabled"} or
"adaptive" / "disabled") becomes the template variable `enable_thinking`; without `thinking` it
is false, as on Anthropic's API; `chat_template_kwargs` is taken as on the OpenAI API. Errors
use Anthropic's shape `{"type": "error", "error": {"type", "message"}}`
(proxy.errors.anthropic_body).

Parsing into the internal, OpenAI-shaped messages:
- `system`: a string or a list of text blocks, joined by blank lines; it becomes the first
  message. `role: "system"` entries inside `messages` (Claude Code sends them) become user
  text, merged into the neighbouring user turn, so templates that allow a system message only
  first still render, and earlier turns render the same when the conversation grows. Leading
  ones (before any user or assistant turn) join the system message instead.
- user content: a string or blocks. `text` blocks join by blank lines; each `tool_result`
  (string or text-block content, `is_error` marked) becomes a `role: "tool"` message; an image,
  file or document block, in a user turn or a tool result, becomes a text placeholder
  (proxy.chat.placeholder; a document with a plain-text source keeps its text). Consecutive
  user turns merge.
- assistant content: `text` joins; `tool_use` becomes a tool call; `thinking` blocks become
  the turn's `reasoning_content`, which the template renders as it wants (signatures are not
  checked: prefixgate wrote them, empty); `redacted_thinking` is dropped. A conversation
  that ends in an assistant turn with text is continued, as the API does it: the prompt ends
  inside that turn (no end-of-turn, no new header) and the reply is only the continuation;
  trailing whitespace there is a 400, as on the API.
- A body that re-sends a recent body's messages (the same objects: ``proxy.limits`` reuses the
  values of text it parsed before) resumes that body's parse after them (`_Recent`): the
  builder never changes a message it made once it is out (a merge replaces it with a merged
  copy), so the messages before the new ones are the same objects as last time, and every
  later stage remembers its work by them (proxy/memo.py).
- tools `{name, description, input_schema}` become function tools; server tools (a `type`
  other than `custom`) are ignored, prefixgate cannot run them. tool_choice auto / any / tool /
  none maps to auto / required / named / none (proxy.tools).

Usage: `input_tokens` prefilled and not newly snapshotted, `cache_read_input_tokens` reused
(live KV or disk), `cache_creation_input_tokens` prefilled into a new snapshot; the three sum to
the prompt length, which is what count_tokens returns for the same body.

Responses, JSON and SSE: proxy/anthropic_reply.py.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from aiohttp import web

from proxy import tools as tools_mod
from proxy.anthropic_reply import Responder
from proxy.chat import (
    ChatRequest,
    expect_dict,
    opt_bool,
    opt_int,
    parse_prefix_cache,
    parse_sampling,
    parse_stop,
    placeholder,
)
from proxy.edge import (
    CONFIG,
    GATEWAY,
    LIMITS,
    MODEL_ID,
    check_auth,
    client_gone,
    failed,
    gone,
    model_card,
    parse_body,
    read_body,
    reject,
    serve,
)
from proxy.errors import ApiError, BadRequest, ContextOverflow, anthropic_response
from proxy.memo import IdMemo
from proxy.openai_api import parse_template_kwargs
from proxy.run import Run

log = logging.getLogger("prefixgate")


_MEDIA = {"image": "image", "document": "document", "file": "file", "container_upload": "file"}
_DROPPED = ("thinking", "redacted_thinking")  # in a user turn


# --- parsing -------------------------------------------------------------------------------


def _where(i: int | None, j: int | None = None) -> str:
    base = "system" if i is None else f"messages[{i}]"
    return base if j is None else f"{base}.content[{j}]"


def _text_blocks(raw: Any, where: str) -> tuple[str, list[str]]:
    """A string, or a list of text blocks joined by blank lines (system, tool_result), and
    the kinds of media replaced by a placeholder in it."""
    if raw is None:
        return "", []
    if isinstance(raw, str):
        return raw, []
    if not isinstance(raw, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks", param=where)
    parts: list[str] = []
    media: list[str] = []
    for j, b in enumerate(raw):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append(b["text"])
        elif isinstance(kind, str) and kind in _MEDIA:
            parts.append(_media_text(b, media))
        else:
            raise BadRequest(f"{where}[{j}] must be a text block ({{\"type\": \"text\", "
                             f"\"text\": ...}}), got type {kind!r}", param=where)
    return "\n\n".join(parts), media


def _media_text(block: dict[str, Any], media: list[str]) -> str:
    """What a media block becomes: a document's plain text where it has one, else the
    placeholder of its kind (added to `media`)."""
    source = block.get("source")
    if block["type"] == "document" and isinstance(source, dict) and \
            source.get("type") == "text" and isinstance(source.get("data"), str):
        return source["data"]
    kind = _MEDIA[block["type"]]
    media.append(kind)
    return placeholder(kind)


def _blocks(content: Any, i: int) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{_where(i)}.content must be a string or a list of content blocks",
                         param=f"{_where(i)}.content")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise BadRequest(f"{_where(i, j)} must be an object with a 'type'",
                             param=_where(i, j))
    return content


class _Builder:
    """Accumulates OpenAI-shaped messages, merging as the module rules say."""

    def __init__(self, system: str) -> None:
        self.system_in = system  # the body's own system text
        self.system = system
        self.out: list[dict[str, Any]] = []
        self.tool_names: dict[str, str] = {}  # tool_use id -> tool name, for tool messages
        self.names: list[tuple[str, str]] = []  # the same, in the order they were met
        self.media: list[str] = []  # the kinds of media replaced by a placeholder
        # after each raw message: (messages out, the last of them, names met, system text,
        # media met)
        self.states: list[tuple[int, dict[str, Any] | None, int, str, int]] = []
        self.head: dict[str, Any] | None = None  # the system message made of `system`

    def checkpoint(self) -> None:
        self.states.append((len(self.out), self.out[-1] if self.out else None, len(self.names),
                            self.system, len(self.media)))

    def resume(self, old: _Builder, n: int) -> None:
        """Be `old` as it was after its first `n` raw messages."""
        n_out, last, n_names, self.system, n_media = old.states[n - 1]
        self.out = [*old.out[: n_out - 1], last] if last is not None else []
        self.names = old.names[:n_names]
        self.media = old.media[:n_media]
        self.tool_names = dict(self.names)
        self.states = old.states[:n]

    def _last_for_merge(self) -> dict[str, Any]:
        """The last message, made a copy of first: a message out is never changed."""
        last = self.out[-1] = dict(self.out[-1])
        return last

    def user_text(self, text: str) -> None:
        last = self.out[-1] if self.out else None
        if last is not None and last["role"] == "user":
            last = self._last_for_merge()
            last["content"] = last["content"] + "\n\n" + text if last["content"] else text
        else:
            self.out.append({"role": "user", "content": text})

    def system_text(self, text: str) -> None:
        if not self.out:
            self.system = self.system + "\n\n" + text if self.system else text
        else:
            self.user_text(text)

    def add(self, m: Any, i: int) -> None:
        if not isinstance(m, dict):
            raise BadRequest(f"{_where(i)} must be an object with 'role' and 'content'",
                             param=_where(i))
        role = m.get("role")
        if role == "system":
            text, media = _text_blocks(m.get("content"), f"{_where(i)}.content")
            self.media += media
            self.system_text(text)
        elif role == "user":
            self._user(_blocks(m.get("content"), i), i)
        elif role == "assistant":
            self._assistant(_blocks(m.get("content"), i), i)
        else:
            raise BadRequest(f"{_where(i)}.role must be user or assistant; got {role!r}",
                             param=f"{_where(i)}.role")

    def _user(self, blocks: list[dict[str, Any]], i: int) -> None:
        text: list[str] = []
        for j, b in enumerate(blocks):
            kind = b["type"]
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind in _MEDIA:
                text.append(_media_text(b, self.media))
            elif kind == "tool_result":
                if text:
                    self.user_text("\n\n".join(text))
                    text = []
                tid = str(b.get("tool_use_id", ""))
                body, media = _text_blocks(b.get("content"), f"{_where(i, j)}.content")
                self.media += media
                msg = {"role": "tool", "tool_call_id": tid,
                       "content": "Error: " + body if b.get("is_error") else body}
                if tid in self.tool_names:
                    msg["name"] = self.tool_names[tid]
                self.out.append(msg)
            elif kind not in _DROPPED:
                raise BadRequest(f"{_where(i, j)}: a user turn takes text, media and "
                                 f"tool_result blocks, not {kind!r}", param=_where(i, j))
        if text or not blocks:
            self.user_text("\n\n".join(text))

    def _assistant(self, blocks: list[dict[str, Any]], i: int) -> None:
        text: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(blocks):
            kind = b["type"]
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "thinking":
                if isinstance(b.get("thinking"), str) and b["thinking"]:
                    thoughts.append(b["thinking"])
            elif kind == "tool_use":
                name, args = b.get("name"), b.get("input", {})
                if not isinstance(name, str) or not isinstance(args, dict):
                    raise BadRequest(f"{_where(i, j)}: tool_use needs a 'name' and an 'input' "
                                     "object", param=_where(i, j))
                tid = str(b.get("id", ""))
                self.tool_names[tid] = name
                self.names.append((tid, name))
                calls.append({"id": tid, "type": "function",
                              "function": {"name": name, "arguments": args}})
            elif kind not in _DROPPED:
                raise BadRequest(f"{_where(i, j)}: an assistant turn takes text, tool_use and "
                                 f"thinking blocks, not {kind!r}", param=_where(i, j))
        msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(text)}
        if calls:
            msg["tool_calls"] = calls
        if thoughts:
            msg["reasoning_content"] = "\n\n".join(thoughts)
        last = self.out[-1] if self.out else None
        if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
            last = self._last_for_merge()
            last["content"] = "\n\n".join(p for p in (last["content"], msg["content"]) if p)
            if thoughts:
                last["reasoning_content"] = "\n\n".join(
                    p for p in (last.get("reasoning_content", ""), msg["reasoning_content"]) if p)
            if calls:
                last["tool_calls"] = calls
        else:
            self.out.append(msg)

    def messages(self, old: _Builder | None = None) -> tuple[dict[str, Any], ...]:
        """The messages; the system message is `old`'s own when its text is the same."""
        if not self.system:
            return tuple(self.out)
        head = old.head if old is not None and old.head is not None and \
            old.head["content"] == self.system else {"role": "system", "content": self.system}
        self.head = head
        return (head, *self.out)


class _Recent:
    """The builders of the last bodies parsed, with the raw messages they took (see the module
    rules); thread-safe."""

    def __init__(self, max_bodies: int = 8) -> None:
        self.max_bodies = max_bodies
        self._parses: list[tuple[list[Any], _Builder]] = []
        self._lock = threading.Lock()

    def find(self, system: str, raw: list[Any]) -> tuple[_Builder | None, int]:
        """The recent builder whose raw messages begin with the most of `raw` (the same
        objects), and how many, at most all but the last."""
        with self._lock:
            parses = list(self._parses)
        best, shared = None, 0
        for old_raw, old in reversed(parses):
            if old.system_in != system or not old_raw or old_raw[0] is not raw[0]:
                continue
            n = min(len(old_raw), len(raw) - 1)
            k = next((i for i in range(n) if old_raw[i] is not raw[i]), n)
            if k > shared:
                best, shared = old, k
        return best, shared

    def add(self, raw: list[Any], b: _Builder, replaces: _Builder | None) -> None:
        with self._lock:
            kept = [p for p in self._parses if p[1] is not replaces]
            self._parses = [*kept[-(self.max_bodies - 1):], (raw, b)]


_RECENT = _Recent()


def parse_tools(raw: Any) -> tuple[dict[str, Any], ...]:
    """The function tools of a body's `tools` (the same list object as a recent body's, as
    ``proxy.limits`` reuses it: the same tuple, so later stages' memos hit)."""
    tools = _TOOLS.get(raw)
    if tools is None:
        tools = _TOOLS.put(raw, _parse_tools(raw))
    return tools


_TOOLS = IdMemo(64)  # a body's tools list -> its function tools


def _parse_tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be a list of {name, description, input_schema}",
                         param="tools")
    tools = []
    for k, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise BadRequest(f"tools[{k}] must be an object with a 'name'", param=f"tools[{k}]")
        if t.get("type") not in (None, "custom"):
            log.info("anthropic: ignoring server tool %r (%s): prefixgate cannot run it",
                     t["name"], t.get("type"))
            continue
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{k}] ({t['name']!r}) needs an 'input_schema' object",
                             param=f"tools[{k}].input_schema")
        fn: dict[str, Any] = {"name": t["name"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = schema
        tools.append({"type": "function", "function": fn})
    return tuple(tools)


def parse_choice(raw: Any, tools: tuple[dict[str, Any], ...]) -> Any:
    if raw is None:
        return "auto"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "tool" and isinstance(raw.get("name"), str):
        choice: Any = {"name": raw["name"]}
    elif kind in ("auto", "none"):
        choice = kind
    elif kind == "any":
        choice = "required"
    else:
        raise BadRequest('\'tool_choice\' must be {"type": "auto" | "any" | "none"} or '
                         '{"type": "tool", "name": ...}', param="tool_choice")
    return tools_mod.check_choice(choice, tools, "tool_choice")


def parse_thinking(body: dict[str, Any]) -> dict[str, Any]:
    """Template variables: `thinking` as `enable_thinking`, plus `chat_template_kwargs` (which
    win). A request without `thinking` has it off, as Anthropic's API treats it: templates with
    the switch (Qwen3, Qwen3.5/3.6, GLM, DeepSeek V3.1) render it off, the others never read it
    (proxy.template.ChatTemplate.bound)."""
    kwargs = parse_template_kwargs({"chat_template_kwargs": body.get("chat_template_kwargs")})
    raw = body.get("thinking")
    if raw is None:
        return {"enable_thinking": False, **kwargs}
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise BadRequest('\'thinking\' must be {"type": "enabled", "budget_tokens": N}, '
                         '{"type": "adaptive"} or {"type": "disabled"}', param="thinking")
    return {"enable_thinking": raw["type"] != "disabled", **kwargs}


def thinking_budget(body: dict[str, Any]) -> dict[str, Any]:
    """`thinking: {"type": "enabled", "budget_tokens": N}` as llama-server's Anthropic API takes
    it: a reasoning budget of N tokens (10000 when N is not given; policies.reasoning_budget)."""
    raw = body.get("thinking")
    if not isinstance(raw, dict) or raw.get("type") != "enabled":
        return {}
    n = raw.get("budget_tokens", 10000)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise BadRequest("'thinking.budget_tokens' must be a non-negative integer",
                         param="thinking.budget_tokens")
    return {"reasoning_budget_tokens": n}


def parse_request(body: Any, tenant: str, count_only: bool = False) -> ChatRequest:
    body = expect_dict(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' is required: a non-empty list of {role, content}",
                         param="messages")
    system, system_media = _text_blocks(body.get("system"), "system")
    b = _Builder(system)
    old, start = _RECENT.find(b.system_in, raw)
    if old is not None:
        b.resume(old, start)
    for i in range(start, len(raw)):
        b.add(raw[i], i)
        b.checkpoint()
    max_tokens = None if count_only else opt_int(body, "max_tokens", 1)
    if max_tokens is None and not count_only:
        raise BadRequest("'max_tokens' is required: the most tokens to generate",
                         param="max_tokens")
    tools = parse_tools(body.get("tools"))
    scope, window = parse_prefix_cache(body)
    last = b.out[-1] if b.out else {}
    continue_final = (last.get("role") == "assistant" and not last.get("tool_calls")
                      and bool(last["content"]))
    if continue_final and last["content"] != last["content"].rstrip():
        raise BadRequest("messages: final assistant content cannot end with trailing whitespace",
                         param=f"messages.{len(raw) - 1}.content")
    messages = b.messages(old)
    _RECENT.add(raw, b, old)
    return ChatRequest(
        api="anthropic", messages=messages, tools=tools,
        tool_choice=parse_choice(body.get("tool_choice"), tools),
        sampling={**parse_sampling({k: body.get(k) for k in ("temperature", "top_p", "top_k")}),
                  **thinking_budget(body)},
        max_tokens=max_tokens, stop=parse_stop(body.get("stop_sequences"), "stop_sequences"),
        stream=False if count_only else opt_bool(body, "stream"), scope=scope, window=window,
        tenant=tenant, continue_final=continue_final, template_kwargs=parse_thinking(body),
        media=(*system_media, *b.media))


# --- handlers ------------------------------------------------------------------------------


async def _respond(request: web.Request, req: ChatRequest, run: Run) -> web.StreamResponse:
    r = Responder(req, run, request.app[MODEL_ID])
    if req.stream:
        return await r.stream(request, request.app[CONFIG].ping_interval_s)
    return await r.json(request)


async def messages(request: web.Request) -> web.StreamResponse:
    return await serve(request, "anthropic", parse_request, anthropic_response, _respond)


def _count_only(body: Any, tenant: str) -> ChatRequest:
    return parse_request(body, tenant, count_only=True)


async def count_tokens(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        tenant = check_auth(request)
        req = await gw.offload(parse_body, await read_body(request), tenant, _count_only,
                               request.app[LIMITS])
        try:
            n = len((await gw.prepare(req)).rendered.ids)
        except ContextOverflow as e:  # counting a prompt too long to run is still counting
            n = e.n_prompt
    except ApiError as e:
        return reject(request, "count_tokens", e, anthropic_response)
    except Exception as e:
        if isinstance(e, ConnectionError) and client_gone(request):
            return gone(request)
        return failed(request, "count_tokens", e, anthropic_response)
    return web.json_response({"input_tokens": n})


async def model_info(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model under any name, in both APIs' fields (the
    Anthropic SDK's models.retrieve; Hermes reads max_model_len / context_length here)."""
    card = model_card(request.app)
    return web.json_response({**card, "type": "model", "display_name": card["id"],
                              "created_at": _iso(card["created"])})


def _iso(t: int) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models/{model_id:.+}", model_info)
