"""DeepSeek V3.1 (and V3.2's non-DSML form): one section of calls,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...
    <｜tool▁calls▁end｜>

arguments streamed a member at a time. Reasoning: the prompt opens `<think>` in thinking mode
and the model closes it with `</think>`.
"""

from __future__ import annotations

from typing import Any

from proxy.dialects.base import Call, Item, Tools, json_section, scan_sections
from proxy.dialects.grammar import args_rule, literal

OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_OPEN, SEP, CALL_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def detect(source: str) -> bool:
    return OPEN in source


def section(text: str, i: int, tools: Tools, final: bool
            ) -> tuple[list[Call], int | None, bool]:
    return json_section(text, i, tools, final, OPEN, CALL_OPEN, SEP, CALL_CLOSE, CLOSE,
                        str.strip)


def scan(text: str, tools: Tools, final: bool, inside: bool,
         think: tuple[str, str] | None) -> list[Item]:
    return scan_sections(text, tools, final, inside, think, (OPEN,), section)


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    alts, rules = [], []
    for n, t in enumerate(tools):
        rule, body = args_rule(t, f"pg{n}-")
        alts.append(f"{literal(OPEN + CALL_OPEN + t['function']['name'] + SEP)} {rule} "
                    f"{literal(CALL_CLOSE + CLOSE)}")
        rules.append(body)
    return "(" + " | ".join(alts) + ")", rules
