"""Kimi K2: one section of calls,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {json}<|tool_call_end|>...<|tool_calls_section_end|>

arguments streamed a member at a time. The template writes history call ids itself
(`functions.NAME:index`), so the ids prefixgate hands out do not reach the prompt.
"""

from __future__ import annotations

from typing import Any

from proxy.dialects.base import Call, Item, Tools, json_section, scan_sections
from proxy.dialects.grammar import args_rule, literal

OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
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


def scan(text: str, tools: Tools, final: bool, inside: bool,
         think: tuple[str, str] | None) -> list[Item]:
    return scan_sections(text, tools, final, inside, think, (OPEN,), section)


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    alts, rules = [], []
    for n, t in enumerate(tools):
        rule, body = args_rule(t, f"pg{n}-")
        head = f"{OPEN}{CALL_OPEN}functions.{t['function']['name']}:0{SEP}"
        alts.append(f"{literal(head)} {rule} {literal(CALL_CLOSE + CLOSE)}")
        rules.append(body)
    return "(" + " | ".join(alts) + ")", rules
