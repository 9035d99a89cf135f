"""Kimi K2: one section of calls,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {json}<|tool_call_end|>...<|tool_calls_section_end|>

arguments streamed a member at a time. The template writes history call ids itself
(`functions.NAME:index`), so the ids prefixgate hands out do not reach the prompt.
"""

from __future__ import annotations

from typing import Any

from proxy.dialects.base import Call, Tools, json_section
from proxy.dialects.grammar import calls

OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
OPENS = (OPEN,)
CALL_OPEN, SEP, CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", \
    "<|tool_call_end|>"


def detect(source: str) -> bool:
    return OPEN in source


def name_of(tool_id: str) -> str:
    """functions.NAME:IDX -> NAME"""
    name = tool_id.strip().removeprefix("functions.")
    return name.rsplit(":", 1)[0] if ":" in name else name


def section(text: str, i: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    return json_section(text, i, tools, final, OPEN, CALL_OPEN, SEP, CALL_CLOSE, CLOSE, name_of)


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    return calls(tools, lambda name: f"{OPEN}{CALL_OPEN}functions.{name}:0{SEP}",
                 CALL_CLOSE + CLOSE)
