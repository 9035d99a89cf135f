"""Anthropic Messages API responses: one run as a message, JSON or SSE (the requests are
proxy/anthropic_api.py's).

Reasoning the model writes is a `thinking` block (before the text or tool use it led to).
Streaming is Anthropic's event sequence: `message_start` (sent once the worker accepted the
plan, with the input usage), `ping`, per block `content_block_start` / `content_block_delta`
(`thinking_delta`, `text_delta`, `input_json_delta`, a tool's arguments as they complete) /
`content_block_stop`, `message_delta` (stop_reason and
usage), `message_stop`. While no event is due (a long prefill) a `ping` goes out every
`ping_interval_s`; Claude Code takes 180 s of silence for a stalled stream. A failure after
the response started is an `event: error`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from proxy.chat import ChatRequest
from proxy.dialects import ArgsDelta, CallDone, CallOpen, Event, ReasoningDelta, TextDelta, events
from proxy.edge import cache_headers, client_gone, sse_response, with_pings
from proxy.errors import ApiError, anthropic_body
from proxy.run import Run
from proxy.run_state import Usage

log = logging.getLogger("prefixgate")


def usage_json(u: Usage) -> dict[str, int]:
    return {"input_tokens": u.input_tokens, "cache_creation_input_tokens": u.created_tokens,
            "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens}


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class Responder:
    """Renders one run as an Anthropic message, JSON or SSE."""

    def __init__(self, req: ChatRequest, run: Run, model_id: str) -> None:
        self.req, self.run, self.model = req, run, model_id
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.n_calls = 0

    def headers(self) -> dict[str, str]:
        return {"request-id": "req_" + self.id[4:], **cache_headers(self.run)}

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): the worker says which stop string matched."""
        run = self.run
        if self.n_calls and run.finish_reason != "length":  # a call max_tokens cut: max_tokens
            return "tool_use", None
        if run.state.stop is not None:
            return "stop_sequence", run.state.stop
        return ("end_turn" if run.finish_reason == "stop" else "max_tokens"), None

    def _events(self) -> AsyncIterator[Event]:
        return events(self.run.pieces(), self.run.prep.stream())

    def message(self, content: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        reason, seq = self.stop() if final else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": seq,
                "usage": usage_json(self.run.usage)}

    async def json(self, request: web.Request) -> web.Response:
        content: list[dict[str, Any]] = []
        async for ev in self._events():
            if isinstance(ev, CallDone):
                self.n_calls += 1
                content.append({"type": "tool_use", "id": "toolu_" + ev.call.id_hex,
                                "name": ev.call.name, "input": ev.call.arguments})
            elif isinstance(ev, TextDelta | ReasoningDelta):
                kind, key = ("text", "text") if isinstance(ev, TextDelta) else \
                    ("thinking", "thinking")
                if content and content[-1]["type"] == kind:
                    content[-1][key] += ev.text
                else:
                    content.append({"type": kind, key: ev.text} if kind == "text" else
                                   {"type": kind, key: ev.text, "signature": ""})
        return web.json_response(self.message(content, final=True), headers=self.headers())

    async def stream(self, request: web.Request, ping_s: float) -> web.StreamResponse:
        resp = await sse_response(request, self.headers())

        async def ping() -> None:
            await resp.write(_sse("ping", {"type": "ping"}))

        start = self.message([], final=False)
        start["usage"]["output_tokens"] = 0
        await resp.write(_sse("message_start", {"type": "message_start", "message": start}))
        await ping()
        blocks = _Blocks()
        try:
            async for ev in with_pings(self._events(), ping_s, ping):
                if isinstance(ev, CallDone):
                    self.n_calls += 1
                data = blocks.event(ev)
                if data:
                    await resp.write(data)
        except ApiError as e:
            if client_gone(request):
                return resp  # the client left; its run was cancelled, nobody to tell
            log.warning("anthropic stream failed after the response started: %s", e.message)
            await resp.write(_sse("error", anthropic_body(e)))
            return resp
        await resp.write(blocks.close())
        reason, seq = self.stop()
        await resp.write(_sse("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": usage_json(self.run.usage)}))
        await resp.write(_sse("message_stop", {"type": "message_stop"}))
        await resp.write_eof()
        return resp


class _Blocks:
    """Events as content blocks: a block opens when the kind of output changes (thinking,
    text, a tool use) and closes before the next one opens."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"

    def event(self, ev: Event) -> bytes:
        if isinstance(ev, TextDelta):
            return self._ensure("text", {"type": "text", "text": ""}) + \
                self._delta({"type": "text_delta", "text": ev.text})
        if isinstance(ev, ReasoningDelta):
            return self._ensure("thinking", {"type": "thinking", "thinking": "",
                                             "signature": ""}) + \
                self._delta({"type": "thinking_delta", "thinking": ev.text})
        if isinstance(ev, CallOpen):
            return self.close() + self._start("tool_use", {
                "type": "tool_use", "id": "toolu_" + ev.id_hex, "name": ev.name, "input": {}})
        if isinstance(ev, ArgsDelta):
            return self._delta({"type": "input_json_delta", "partial_json": ev.json})
        return self.close()  # CallDone

    def close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _block_stop(self.index)

    def _ensure(self, kind: str, block: dict[str, Any]) -> bytes:
        return b"" if self.open == kind else self.close() + self._start(kind, block)

    def _start(self, kind: str, block: dict[str, Any]) -> bytes:
        self.index += 1
        self.open = kind
        return _sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                            "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                            "delta": delta})


def _block_stop(index: int) -> bytes:
    return _sse("content_block_stop", {"type": "content_block_stop", "index": index})
