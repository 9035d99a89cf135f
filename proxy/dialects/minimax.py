"""MiniMax-M2: one `<minimax:tool_call>` section holding `<invoke name="NAME">` calls, each with
`<parameter name="K">V</parameter>` values (bare text read by the schema type), closed by
`</invoke>` and `</minimax:tool_call>`. Reasoning in `<think>`.
"""

from __future__ import annotations

import re
from typing import Any

from proxy.dialects.base import Call, Tools, skip_ws, xml_call
from proxy.dialects.grammar import calls, xml_args

OPEN, CLOSE, INVOKE = "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="'
OPENS = (OPEN,)
_INVOKE = re.compile(r'<invoke name="([^"\n]*)">')
_PARAM = re.compile(r'<parameter name="([^"\n]*)">')


def detect(source: str) -> bool:
    return OPEN in source


def section(text: str, i: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    calls: list[Call] = []
    pos = i + len(OPEN)
    while True:
        k = skip_ws(text, pos)
        if text.startswith(CLOSE, k):
            return calls, k + len(CLOSE), bool(calls)
        m = _INVOKE.match(text, k)
        if m is None:
            rest = text[k:]
            partial = CLOSE.startswith(rest) or INVOKE.startswith(rest) or \
                (rest.startswith(INVOKE) and ">" not in rest)
            if partial and not final:
                return calls, None, True
            return calls, (k if calls else None), False
        call, end, ok = xml_call(text, m.end(), m.group(1), tools, final, _PARAM,
                                 "</parameter>", "</invoke>")
        if call is not None:
            calls.append(call)
        if end is None or call is None:
            return calls, None, ok
        pos = end


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    return calls(tools, lambda name: f'{OPEN}\n{INVOKE}{name}">\n', "</invoke>\n" + CLOSE,
                 xml_args(lambda p: (f'<parameter name="{p}">', "</parameter>\n")))
