"""gpt-oss (OpenAI's Harmony format): the answer is a run of messages,

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}
    <|start|>assistant<|channel|>final<|message|>answer

(`<|call|>` and `<|return|>` end generation; the recipient may also sit before the channel).
The analysis channel is reasoning, final and recipient-less commentary are text, a message to
`functions.NAME` is a call whose JSON arguments stream a member at a time. A reply with no
channel header at all is text.
"""

from __future__ import annotations

import re
from typing import Any

from proxy.dialects.base import Item, Text, Think, Tools, held, json_call
from proxy.dialects.grammar import calls

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_ROLE = re.compile(r"<\|start\|>\s*assistant")


def detect(source: str) -> bool:
    return CHANNEL in source and "<|call|>" in source


def scan(text: str, tools: Tools, final: bool, inside: bool,
         think: tuple[str, str] | None) -> list[Item]:
    items: list[Item] = []
    pos = 0
    if CHANNEL not in text and not text.lstrip().startswith("to="):
        keep = 0 if final else held(text, (CHANNEL, START, " to="))
        return [Text(text[: len(text) - keep])]
    while pos < len(text):
        m = _ROLE.match(text, pos)
        if m:
            pos = m.end()
        h = text.find(MESSAGE, pos)
        if h < 0:
            return items  # a header still being written
        header = text[pos:h]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        body_at = h + len(MESSAGE)
        ends = [(j, e) for e in ENDS if (j := text.find(e, body_at)) >= 0]
        j, end = min(ends) if ends else (len(text), "")
        body = text[body_at:j]
        closed = bool(end) or final
        if not end and not final:
            body = body[: len(body) - held(body, ENDS)]
        name = recipient.group(1) if recipient else ""
        if name and tools.types:
            call, _, _ = json_call(name.removeprefix("functions."), body, closed, tools)
            if call is None:
                if not closed:
                    return items
                items.append(Text(body))
            else:
                items.append(call)
        elif channel is not None and channel.group(1) == "analysis":
            items.append(Think(body))
        else:
            items.append(Text(body))
        if not end:
            return items
        pos = j + (len(end) if end != START else 0)
    return items


def grammar(tools: list[dict[str, Any]]) -> tuple[str, list[str]]:
    return calls(tools, lambda name: f"{CHANNEL}commentary to=functions.{name} "
                 f"<|constrain|>json{MESSAGE}", "")


def history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The template reads an assistant turn's reasoning from `thinking`. A turn with both
    reasoning and tool calls loses its text (what the model wrote on the commentary channel
    before the call, which Claude Code echoes beside its thinking and tool_use blocks): the
    template refuses content and thinking beside tool calls ("Cannot pass both content and
    thinking..."), and llama-server maps such a turn the same way (its gpt-oss chat params
    drop `content` where `reasoning_content` and tool calls meet), so both render one prompt."""
    return [m if not m.get("reasoning_content") else {
        **{k: v for k, v in m.items()
           if k != "reasoning_content" and not (k == "content" and m.get("tool_calls"))},
        "thinking": m["reasoning_content"]} for m in messages]
