"""Mistral and Devstral: `[TOOL_CALLS]NAME[ARGS]{json}` per call (Devstral Small 2507,
Mistral Small 3.2, Magistral), or the older `[TOOL_CALLS][{"name": ..., "arguments": {...}},
...]` (Mistral Nemo). No closing marker: a call ends with its JSON. Arguments of the first form
stream a member at a time; the older list is read whole.
"""

from __future__ import annotations

from typing import Any

from proxy.dialects.base import DECODER, Call, Tools, json_call, skip_ws
from proxy.dialects.grammar import calls
from proxy.dialects.hermes import call_of

OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"
OPENS = (OPEN,)


def detect(source: str) -> bool:
    return OPEN in source


def section(text: str, i: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    start = skip_ws(text, i + len(OPEN))
    if text.startswith("[", start) and not text.startswith(ARGS, start):
        return _listed(text, start, tools, final)
    a = text.find(ARGS, start)
    if a < 0:
        rest = text[start:]
        b = rest.find("[")
        maybe = (b < 0 and len(rest) < 256) or (b >= 0 and ARGS.startswith(rest[b:]))
        return [], None, maybe and not final
    body_at = a + len(ARGS)
    call, ok, end = json_call(text[start:a].strip(), text[body_at:], final, tools)
    if call is None:
        return [], None, ok
    return [call], (body_at + end if end is not None else None), True


def _listed(text: str, start: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    try:
        listed, end = DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return [], None, not final
    if not isinstance(listed, list):
        return [], None, False

    found = [call_of(c, tools) for c in listed]
    if not found or any(c is None for c in found):
        return [], None, False
    return [c for c in found if c is not None], end, True


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    return calls(tools, lambda name: OPEN + name + ARGS, "")
