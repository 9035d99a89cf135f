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

from proxy.dialects.base import _DECODER, Call, Item, Tools, json_call, scan_sections
from proxy.dialects.grammar import args_rule, literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
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
        obj = _DECODER.decode(body.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
            or not tools.declared(obj["name"]):
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _DECODER.decode(args)
        except (ValueError, RecursionError):
            return None
    return Call(obj["name"], list(args.items()), closed=True) if isinstance(args, dict) else None


def scan(text: str, tools: Tools, final: bool, inside: bool,
         think: tuple[str, str] | None) -> list[Item]:
    return scan_sections(text, tools, final, inside, think, (OPEN,), section)


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """One call to one of `tools`: (the root expression, its rules)."""
    alts, rules = [], []
    for n, t in enumerate(tools):
        rule, body = args_rule(t, f"pg{n}-")
        head = OPEN + '\n{"name": ' + json.dumps(t["function"]["name"], ensure_ascii=False) + \
            ', "arguments": '
        alts.append(f"{literal(head)} {rule} {literal('}' + chr(10) + CLOSE)}")
        rules.append(body)
    return "(" + " | ".join(alts) + ")", rules
