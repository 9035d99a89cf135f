"""Replay traces: JSONL files, one stateless chat request per line, read as OpenAI chat bodies.

Two row formats, told apart per row (`detect_format`):

- **Anthropic Messages** (the traces in shared/traces/, and what `bench.synth` writes): `system`
  (a string or text blocks), `messages` whose `content` is a string or blocks (`text`,
  `tool_use`, `tool_result`, `thinking`, `image`), `tools` with `input_schema`, `tool_choice`,
  `max_tokens`, `temperature`, `stop_sequences`. A row is Anthropic when it has `system`, a tool
  with `input_schema`, or a content block of an Anthropic-only type.
- **OpenAI chat**: a `/v1/chat/completions` body (`messages` with system/tool roles, `tools` of
  `{type: function, function}`), taken as it is.

The conversion is the harness's own, so the benchmark does not depend on the proxy's Anthropic
endpoint: the system text becomes a leading system message; `tool_use` blocks become assistant
`tool_calls` (arguments as a JSON string) and `tool_result` blocks become `tool` messages placed
before the rest of their user turn, as OpenAI requires; with `tool_blocks="text"` both are
rendered as plain text instead (for templates that ignore `tool_calls`). `thinking` blocks are
dropped (clients do not resend them as text), an image becomes the text `[image]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_ANTHROPIC_BLOCKS = {"tool_use", "tool_result", "thinking", "redacted_thinking", "image",
                     "document"}


def detect_format(row: dict[str, Any]) -> str:
    """'anthropic' or 'openai' (rows with only plain user/assistant strings read the same)."""
    if "system" in row or any(isinstance(t, dict) and "input_schema" in t
                              for t in row.get("tools") or ()):
        return "anthropic"
    for m in row.get("messages") or ():
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list) and any(isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS
                                       for b in c):
            return "anthropic"
    return "openai"


def _text_of(content: Any) -> str:
    """A tool_result's content (a string or text blocks) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") if isinstance(b, dict) and b.get("type") == "text"
                       else "[image]" if isinstance(b, dict) and b.get("type") == "image"
                       else "" for b in content)
    return json.dumps(content, ensure_ascii=False)


def _system_text(system: Any) -> str:
    if isinstance(system, list):
        return "".join(b.get("text", "") for b in system if isinstance(b, dict))
    return system or ""


def _convert_message(m: dict[str, Any], tool_blocks: str) -> list[dict[str, Any]]:
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for b in content or ():
        kind = b.get("type")
        if kind == "text":
            texts.append(b.get("text", ""))
        elif kind == "image":
            texts.append("[image]")
        elif kind == "tool_use":
            args = json.dumps(b.get("input", {}), ensure_ascii=False)
            if tool_blocks == "text":
                texts.append(f"[tool_use {b.get('name', '')} {b.get('id', '')}] {args}")
            else:
                calls.append({"id": b.get("id", ""), "type": "function",
                              "function": {"name": b.get("name", ""), "arguments": args}})
        elif kind == "tool_result":
            body = _text_of(b.get("content"))
            if b.get("is_error"):
                body = "[error] " + body
            if tool_blocks == "text":
                texts.append(f"[tool_result {b.get('tool_use_id', '')}] {body}")
            else:
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""),
                                "content": body})
        # thinking / redacted_thinking: not part of the resent prompt
    out: list[dict[str, Any]] = list(results)
    text = "\n".join(t for t in texts if t) if len(texts) > 1 else "".join(texts)
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif text or not results:
        out.append({"role": role, "content": text})
    return out


def _convert_tool_choice(tc: Any) -> Any:
    if not isinstance(tc, dict):
        return tc
    kind = tc.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name", "")}}
    return kind or "auto"  # auto, none


def anthropic_to_openai(row: dict[str, Any], tool_blocks: str = "openai") -> dict[str, Any]:
    """One Anthropic Messages request as the equivalent OpenAI chat body."""
    messages: list[dict[str, Any]] = []
    system = _system_text(row.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for m in row.get("messages") or ():
        messages.extend(_convert_message(m, tool_blocks))
    body: dict[str, Any] = {"model": row.get("model", ""), "messages": messages}
    if row.get("tools"):
        body["tools"] = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("input_schema", {"type": "object", "properties": {}})}}
            for t in row["tools"]]
        if "tool_choice" in row:
            body["tool_choice"] = _convert_tool_choice(row["tool_choice"])
    for name in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if name in row:
            body[name] = row[name]
    if row.get("stop_sequences"):
        body["stop"] = list(row["stop_sequences"])
    return body


def to_openai(row: dict[str, Any], fmt: str = "auto", tool_blocks: str = "openai"
              ) -> dict[str, Any]:
    if fmt == "auto":
        fmt = detect_format(row)
    if fmt == "anthropic":
        return anthropic_to_openai(row, tool_blocks)
    if fmt == "openai":
        return dict(row)
    raise ValueError(f"unknown trace format {fmt!r}: use auto, anthropic or openai")


def load_rows(path: str | Path, fmt: str = "auto", turns: int | None = None
              ) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a JSONL trace as they are, each with its format ('anthropic' or 'openai'):
    what a client sends, for `/v1/messages` or `/v1/chat/completions`."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not JSON: {e}") from None
            rows.append((detect_format(row) if fmt == "auto" else fmt, row))
            if turns is not None and len(rows) >= turns:
                break
    return rows


def load_trace(path: str | Path, fmt: str = "auto", tool_blocks: str = "openai",
               turns: int | None = None) -> list[dict[str, Any]]:
    """The rows of a JSONL trace as OpenAI chat bodies, in order (the first `turns` only)."""
    return [to_openai(row, kind, tool_blocks) for kind, row in load_rows(path, fmt, turns)]
