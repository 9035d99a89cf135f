"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`,
one block per call. Arguments stream a member at a time when the object names the tool first
(as every Hermes-style template shows it); any other order is read whole at the closing tag.
Templates: NousResearch Hermes 2/3, Qwen2.5, Qwen3 (with `<think>` reasoning), QwQ, and
prefixgate's own tools section for templates that take no tools (proxy/tools.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from proxy.dialects.base import DECODER, Call, Tools, json_call
from proxy.dialects.grammar import calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
OPENS = (OPEN,)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"'
                   r'\s*:\s*')


def detect(source: str) -> bool:
    return OPEN in source


def section(text: str, i: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    start = i + len(OPEN)
    m = _HEAD.match(text, start)
    if m and not text.startswith('"', m.end()):  # arguments as a JSON string: read whole
        # the object is read first: its strings may hold the closing tag
        call, ok, end = json_call(json.loads(m.group(1)), text[m.end():], final, tools)
        if end is not None:
            j = text.find(CLOSE, m.end() + end)
            end = j + len(CLOSE) if j >= 0 else None
        return ([call] if call else []), end, ok
    j = text.find(CLOSE, start)
    if j < 0 and not final:
        return [], None, True  # maybe the head is still being written; else read whole at end
    call = whole(text[start: j if j >= 0 else len(text)], tools)
    return ([call] if call else []), (j + len(CLOSE) if j >= 0 else None), call is not None


def whole(body: str, tools: Tools) -> Call | None:
    """`{"name", "arguments"}` in any order, the arguments an object or a JSON string."""
    try:
        return call_of(DECODER.decode(body.strip()), tools)
    except (ValueError, RecursionError):
        return None


def call_of(obj: Any, tools: Tools) -> Call | None:
    """A decoded `{"name", "arguments"}` (or "parameters") object as a call, if it is one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
            or not tools.declared(obj["name"]):
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = DECODER.decode(args)
        except (ValueError, RecursionError):
            return None
    return Call(obj["name"], list(args.items()), closed=True) if isinstance(args, dict) else None


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    return calls(tools, lambda name: OPEN + '\n{"name": ' + json.dumps(name, ensure_ascii=False)
                 + ', "arguments": ', "}\n" + CLOSE)
