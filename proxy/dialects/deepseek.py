"""DeepSeek V3.1: one section of calls,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...
    <｜tool▁calls▁end｜>

arguments streamed a member at a time. Reasoning: the prompt opens `<think>` in thinking mode
and the model closes it with `</think>`. The template renders calls and results but not the
tools themselves: `tools_section` writes them into the system prompt as DeepSeek's model card
shows.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.dialects.base import Call, Tools, json_section
from proxy.dialects.grammar import calls, strip_schema_noise

OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
OPENS = (OPEN,)
CALL_OPEN, SEP, CALL_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def detect(source: str) -> bool:
    return OPEN in source


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The tools as DeepSeek V3.1's model card puts them in the system prompt."""
    parts = ["## Tools\nYou have access to the following tools:"]
    for t in tools:
        fn = t["function"]
        params = json.dumps(strip_schema_noise(fn.get("parameters") or {"type": "object"}),
                            ensure_ascii=False)
        parts.append(f"### {fn['name']}\nDescription: {fn.get('description') or ''}\n\n"
                     f"Parameters: {params}")
    parts.append(
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        f"{OPEN}{CALL_OPEN}tool_call_name{SEP}tool_call_arguments{CALL_CLOSE}"
        f"{{{{additional_tool_calls}}}}{CLOSE}\n\n"
        "Where:\n\n- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters "
        "Schema\n- For multiple tool calls, chain them directly without separators or spaces")
    return "\n\n".join(parts)


def section(text: str, i: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    return json_section(text, i, tools, final, OPEN, CALL_OPEN, SEP, CALL_CLOSE, CLOSE,
                        str.strip)


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    return calls(tools, lambda name: OPEN + CALL_OPEN + name + SEP, CALL_CLOSE + CLOSE)
