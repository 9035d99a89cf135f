"""Tools into the prompt, for both APIs (what the model writes back is its dialect's business:
proxy/dialects/).

Rules:
- Tools arrive OpenAI-shaped (`{"type": "function", "function": {name, description,
  parameters}}`); the Anthropic edge converts its `{name, description, input_schema}` to that.
  `tool_choice` is "auto", "none", "required" or `{"name": NAME}`.
- Into the prompt: a template that reads `tools` gets them as they are, and the messages keep
  `tool_calls`, `reasoning_content` and `role: "tool"` (the dialect may rename fields its
  template reads differently). A template that does not (SmolLM2's reads only `role` and
  `content`) gets them in the Hermes convention, exactly as Qwen2.5's template writes it: a
  `# Tools` section with one JSON line per tool inside `<tools></tools>` appended to the first
  system message (created when absent); assistant tool calls become `<tool_call>\n{"name": ...,
  "arguments": {...}}\n</tool_call>` lines in the content; tool results become a user message
  of `<tool_response>\n...\n</tool_response>` blocks (consecutive results and a user message that
  follows them share one user message). The rendering depends only on the messages, so a
  conversation re-sent with one more turn renders its old turns to the same tokens.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from typing import Any

from proxy.dialects.grammar import strip_schema_noise
from proxy.dialects.hermes import CLOSE, OPEN
from proxy.errors import BadRequest
from proxy.memo import IdMemo, PrefixMemo

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# --- the request side ----------------------------------------------------------------------


def parse_choice(raw: Any, tools: tuple[dict[str, Any], ...], param: str = "tool_choice") -> Any:
    """OpenAI's tool_choice ("auto" | "none" | "required" | {"type": "function", "function":
    {"name"}}) or the internal {"name"} -> "auto" | "none" | "required" | {"name": NAME}."""
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        choice: Any = raw
    elif isinstance(raw, dict):
        fn = raw.get("function") if isinstance(raw.get("function"), dict) else raw
        name = fn.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"'{param}' must be auto, none, required or "
                             '{"type": "function", "function": {"name": ...}}', param=param)
        choice = {"name": name}
    else:
        raise BadRequest(f"'{param}' must be auto, none, required or "
                         '{"type": "function", "function": {"name": ...}}', param=param)
    return check_choice(choice, tools, param)


def check_choice(choice: Any, tools: tuple[dict[str, Any], ...], param: str) -> Any:
    names = tool_names(tools)
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            raise BadRequest(f"'{param}' forces a tool call but no 'tools' were given",
                             param=param)
        if isinstance(choice, dict) and choice["name"] not in names:
            raise BadRequest(f"'{param}' names the tool {choice['name']!r}, which is not in "
                             f"'tools' ({', '.join(sorted(names))})", param=param)
    return choice


def tool_names(tools: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in tools)


def apply(supports_tools: bool, messages: list[dict[str, Any]],
          tools: tuple[dict[str, Any], ...], tools_first: bool = False,
          section: Callable[[list[dict[str, Any]]], str] | None = None
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for the template) for one request: see the module rules. `section`:
    the template renders calls and results but not the tools; this writes them."""
    if supports_tools:
        return messages, list(tools) or None
    if section is not None:
        return (with_section(messages, section(list(tools)), tools_first) if tools
                else messages), None
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, None
    return hermes_messages(messages, tools, tools_first), None


def with_section(messages: list[dict[str, Any]], section: str, tools_first: bool
                 ) -> list[dict[str, Any]]:
    """`section` joined to the first system message (before its text when `tools_first`), or
    a system message of its own."""
    if messages and messages[0].get("role") == "system":
        body = messages[0].get("content") or ""
        parts = [section, body] if tools_first else [body, section]
        return [{**messages[0], "content": "\n\n".join(p for p in parts if p)}, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def tools_section(tools: tuple[dict[str, Any], ...]) -> str:
    lines = [json.dumps(strip_schema_noise(t), ensure_ascii=False) for t in tools]
    return TOOLS_PREAMBLE + "".join("\n" + line for line in lines) + TOOLS_POSTAMBLE


def call_text(name: str, arguments: Any) -> str:
    return OPEN + "\n" + json.dumps({"name": name, "arguments": arguments},
                                    ensure_ascii=False) + "\n" + CLOSE


def hermes_messages(messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...],
                    tools_first: bool = False) -> list[dict[str, Any]]:
    """Messages for a template without tool support: everything tool-related becomes text.
    `tools_first`: the tools section before the system text (stable first), else after it.
    Each message it writes comes from one message, or from a run of tool results and the user
    message after them; it is remembered by the messages it came from (proxy/memo.py), so a
    history sent again gives the same objects without the work."""
    out: list[dict[str, Any]] = []
    if tools:  # the system message, joined or new
        section = _SECTIONS.get(tools)
        if section is None:
            section = _SECTIONS.put(tools, tools_section(tools))
        head = messages[0] if messages and messages[0].get("role") == "system" else None
        key = (head, section, tools_first)
        done = _HEADS.get(tools)
        if done is None or done[0] is not head or done[1:3] != key[1:]:
            done = _HEADS.put(tools, (*key, with_section(messages[:1], section,
                                                         tools_first)[0]))
        out.append(done[3])
        if head is not None:
            messages = messages[1:]
    # a history sent again: its groups carried on, but those its new messages may change
    hit = _HISTORIES.found(messages)
    groups, begins = list[dict[str, Any]](), list[int]()  # per group: its message, first index
    i, n = 0, len(messages)
    if hit is not None:  # a group whose next begins among the shared messages ends as it did
        k, (kept, starts) = hit
        r = max(bisect.bisect_left(starts, k) - 1, 0)
        groups, begins, i = list(kept[:r]), list(starts[:r]), starts[r]
    while i < n:
        begins.append(i)
        j = i + 1
        if messages[i].get("role") == "tool":  # a run of tool results, and the user after it
            while j < n and messages[j].get("role") == "tool":
                j += 1
            if j < n and messages[j].get("role") == "user":
                j += 1
        group = messages[i:j]
        done = _GROUPS.get(group[-1])
        if done is None or done[0] != group:  # compared in C; identical items cost nothing
            done = _GROUPS.put(group[-1], (group, _hermes_group(group)))
        groups.append(done[1])
        i = j
    _HISTORIES.keep(messages, (tuple(groups), tuple(begins)))
    out.extend(groups)
    return out


def _hermes_group(group: list[dict[str, Any]]) -> dict[str, Any]:
    m = group[0]
    role = m.get("role")
    if role == "assistant" and m.get("tool_calls"):
        calls = [call_text(c["function"]["name"], c["function"].get("arguments", {}))
                 for c in m["tool_calls"]]
        content = m.get("content") or ""
        return {"role": "assistant", "content": "\n".join([content, *calls] if content else calls)}
    if role != "tool":
        return {"role": role, "content": m.get("content") or ""}
    text = "\n".join("<tool_response>\n" + (t.get("content") or "") + "\n</tool_response>"
                     for t in group if t.get("role") == "tool")
    if group[-1].get("role") == "user":
        text += "\n" + group[-1]["content"]
    return {"role": "user", "content": text}


_SECTIONS = IdMemo(256)  # tools -> their section
_HEADS = IdMemo(256)  # tools -> (system message, section, tools first, the joined message)
_GROUPS = IdMemo()  # last message of a group -> (the group, the message it gives)
_HISTORIES = PrefixMemo()  # messages -> (the message of each group, the index it begins at)
