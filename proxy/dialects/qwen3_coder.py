"""Qwen3-Coder, Qwen3.5 and Qwen3.6: XML calls,

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

one block per call. A value is bare text (one newline either side trimmed) read by its
parameter's schema type; arguments stream a parameter at a time. Qwen3.5/3.6 reason in
`<think>` first. A block whose `<tool_call>` the model left out still counts (Qwen3-Coder does
that).
"""

from __future__ import annotations

import re
from typing import Any

from proxy.dialects.base import Call, Tools, skip_ws, xml_call
from proxy.dialects.grammar import calls, xml_args

OPEN, CLOSE, FUNCTION = "<tool_call>", "</tool_call>", "<function="
OPENS = (OPEN, FUNCTION)
_FN = re.compile(r"<function=([^>\n]*)>")
_PARAM = re.compile(r"<parameter=([^>\n]*)>")


def detect(source: str) -> bool:
    return FUNCTION in source and "<parameter=" in source


def section(text: str, i: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    opened = text.startswith(OPEN, i)
    j = skip_ws(text, i + len(OPEN)) if opened else i
    m = _FN.match(text, j)
    if m is None:
        rest = text[j:]
        maybe = FUNCTION.startswith(rest) or (rest.startswith(FUNCTION) and ">" not in rest)
        return [], None, maybe and not final
    call, end, ok = xml_call(text, m.end(), m.group(1).strip(), tools, final, _PARAM,
                             "</parameter>", "</function>", trim_newlines=True)
    if call is None or end is None:
        return ([call] if call else []), None, ok
    k = skip_ws(text, end)
    if text.startswith(CLOSE, k):
        return [call], k + len(CLOSE), True
    if not final and CLOSE.startswith(text[k:]):
        return [call], None, True  # the closing tag may still come
    return [call], end, True


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    return calls(tools, lambda name: f"{OPEN}\n<function={name}>\n",
                 "</function>\n" + CLOSE,
                 xml_args(lambda p: (f"<parameter={p}>\n", "\n</parameter>\n")))
