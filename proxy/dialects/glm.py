"""GLM-4.5, 4.6 and 4.7: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
</tool_call>` (4.5/4.6 put newlines between the parts, 4.7 none), one block per call. A value
is bare text read by its parameter's schema type (the templates write non-strings as JSON);
arguments stream a parameter at a time. Reasoning in `<think>`.
"""

from __future__ import annotations

import re
from typing import Any

from proxy.dialects.base import Call, Tools, xml_call
from proxy.dialects.grammar import calls, xml_args

OPEN, CLOSE = "<tool_call>", "</tool_call>"
OPENS = (OPEN,)
_PARAM = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)
_NAME_END = re.compile(r"\n|<arg_key>|</tool_call>")


def detect(source: str) -> bool:
    return "<arg_key>" in source


def section(text: str, i: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    start = i + len(OPEN)
    m = _NAME_END.search(text, start)
    if m is None:
        name = text[start:].strip()
        if final or len(name) > 256:
            return [], None, False
        return [], None, True
    call, end, ok = xml_call(text, m.start(), text[start:m.start()].strip(), tools, final,
                             _PARAM, "</arg_value>", CLOSE)
    return ([call] if call else []), end, ok


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    return calls(tools, lambda name: OPEN + name + "\n", CLOSE, xml_args(
        lambda p: (f"<arg_key>{p}</arg_key>\n<arg_value>", "</arg_value>\n")))
