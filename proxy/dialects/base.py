"""What every dialect shares: the items a scan finds and the helpers that find them (the events
a stream emits, and the stream that turns one into the other: proxy/dialects/stream.py).

A dialect's `scan(text, tools, final)` reads the whole generated text so far and returns its
items in order: `Text`, `Think` (reasoning) and `Call`. A stream calls it again after every
piece and emits only what is new, so a dialect is written as a plain parser of a finished
string, and streaming comes from the one differ, `Stream`. The rules a scan keeps, so that the
difference is always an extension:

- Items only grow. Text and reasoning grow at their end; a call gains arguments, then closes.
  Text that may still turn into a marker (`<tool_c` at the end) is held back until it cannot.
- A call is reported once its name is a declared tool and its first argument is complete (or
  its arguments closed empty): text that is not a valid call to a declared tool stays text.
  From then on it stays a call. Arguments are reported a whole member at a time (a complete
  `"key": value`, a `</parameter>`), so what has been streamed always closes to a valid JSON
  object: a call cut short (max_tokens, a format broken later) is closed with the arguments
  that completed.
- Whitespace next to a call is dropped; reasoning is stripped of its surrounding whitespace.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("prefixgate")

DECODER = json.JSONDecoder(strict=False)  # models write raw newlines inside JSON strings


# --- what a scan finds ---------------------------------------------------------------------


@dataclass(slots=True)
class Text:
    text: str


@dataclass(slots=True)
class Think:
    text: str


@dataclass(slots=True)
class Call:
    name: str
    members: list[tuple[str, Any]] = field(default_factory=list)  # complete arguments, in order
    closed: bool = False


Item = Text | Think | Call


@dataclass(frozen=True, slots=True)
class Tools:
    """The declared tools as a scan needs them: names, and each parameter's JSON schema type
    (XML dialects write values as bare text and the type says how to read them back)."""

    types: dict[str, dict[str, Any]]  # tool name -> parameter name -> its schema

    @classmethod
    def of(cls, tools: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> Tools:
        types: dict[str, dict[str, Any]] = {}
        for t in tools:
            fn = t["function"]
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            types[fn["name"]] = props if isinstance(props, dict) else {}
        return cls(types)

    def declared(self, name: str) -> bool:
        return name in self.types

    def value(self, tool: str, param: str, raw: str) -> Any:
        """A parameter written as bare text, read as its schema says: strings as they are,
        anything else as JSON when it parses (else as the text)."""
        schema = self.types.get(tool, {}).get(param)
        kinds = _schema_types(schema)
        if kinds and kinds <= {"string"}:
            return raw
        try:
            return DECODER.decode(raw.strip())
        except (ValueError, RecursionError):
            return raw


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return {"string"}
    return set()


# --- helpers for scans ---------------------------------------------------------------------


def held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(text), len(m) - 1), best, -1):
            if m.startswith(text[-n:]):
                best = n
                break
    return best


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def json_members(s: str, i: int) -> tuple[list[tuple[str, Any]], int | None, bool]:
    """The JSON object starting at s[i] ('{'), read as far as it goes: (complete members,
    the index after its '}' or None while open, False when it cannot be an object). A
    member counts once the ',' or '}' after its value is there (a number may still grow)."""
    members: list[tuple[str, Any]] = []
    if i >= len(s) or s[i] != "{":
        return members, None, i >= len(s)
    i = skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        return members, i + 1, True
    while i < len(s):
        if s[i] != '"':
            return members, None, False
        try:
            key, j = DECODER.raw_decode(s, i)
        except (ValueError, RecursionError):
            return members, None, True  # the key is still being written
        j = skip_ws(s, j)
        if j >= len(s):
            return members, None, True
        if s[j] != ":":
            return members, None, False
        j = skip_ws(s, j + 1)
        try:
            value, k = DECODER.raw_decode(s, j)
        except (ValueError, RecursionError):
            return members, None, True
        k = skip_ws(s, k)
        if k >= len(s):
            return members, None, True
        if s[k] not in ",}":
            return members, None, False
        members.append((key, value))
        if s[k] == "}":
            return members, k + 1, True
        i = skip_ws(s, k + 1)
    return members, None, True


def json_call(name: str, body: str, final: bool, tools: Tools
              ) -> tuple[Call | None, bool, int | None]:
    """(a call whose arguments are the JSON object starting `body` (after whitespace), or None
    while it cannot be reported yet; False once it never can; the index in `body` after the
    object, None while it is open). `final`: the body is all there is."""
    if not tools.declared(name):
        return None, False, None
    members, end, ok = json_members(body, skip_ws(body, 0))
    if not ok and not members:
        return None, False, None
    call = Call(name, members, closed=end is not None or not ok)
    if final and end is None:
        if not members:
            return None, False, None
        call.closed = True  # cut short: closed with what completed
    return (call if call.members or call.closed else None), True, end


def split_think(text: str, tags: tuple[str, str] | None, inside: bool, final: bool
                ) -> tuple[str | None, bool, str]:
    """(reasoning or None, reasoning closed, the rest) for models that reason in a block at
    the start of their answer: `inside` when the prompt opened the block, else only when the
    text starts with the open tag."""
    if tags is None:
        return None, False, text
    open_, close = tags
    if not inside:
        lead = text.lstrip()
        if lead.startswith(open_):
            text = lead[len(open_):]
        elif open_.startswith(lead) and lead and not final:
            return "", False, ""  # maybe the open tag, not complete yet
        else:
            return None, False, text
    j = text.find(close)
    if j < 0:  # (tidy strips the reasoning)
        return text[: len(text) - (0 if final else held(text, (close,)))], False, ""
    return text[:j], True, text[j + len(close):]


def tidy(items: list[Item], final: bool) -> list[Item]:
    """Whitespace next to calls dropped, empty text dropped, reasoning whitespace trimmed, the
    trailing whitespace of the last text held back until the end (a call may follow)."""
    out: list[Item] = []
    items = merge(items)
    calls = any(isinstance(x, Call) for x in items)
    for k, x in enumerate(items):
        if isinstance(x, Text):
            t = x.text
            if k > 0 and isinstance(items[k - 1], Call | Think):
                t = t.lstrip()
            if k + 1 < len(items) and isinstance(items[k + 1], Call):
                t = t.rstrip()
            if k + 1 == len(items) and (not final or calls):
                t = t.rstrip()
            if t:
                out.append(Text(t))
        elif isinstance(x, Think):
            t = x.text.strip()
            if t or k + 1 < len(items):
                out.append(Think(t))
        else:
            out.append(x)
    return out


# --- the common shape: reasoning first, then text with call sections ------------------------

# a section parser: (text, index of its open marker, tools, final) -> (calls reported, index
# after the section or None while it is open, False once it cannot hold a call)
Section = Any


def scan_sections(text: str, tools: Tools, final: bool, inside: bool, *,
                  think: tuple[str, str] | None, opens: tuple[str, ...],
                  section: Section) -> list[Item]:
    """Reasoning (see `split_think`), then text in which each of `opens` starts a section that
    `section` parses into calls. A section that holds no call is text."""
    reasoning, closed, rest = split_think(text, think, inside, final)
    items: list[Item] = []
    if reasoning is not None:
        items.append(Think(reasoning))
        if not closed:
            return items
    if not tools.types:
        return items + [Text(rest)]
    pos = 0
    while True:
        hits = [(j, m) for m in opens if (j := rest.find(m, pos)) >= 0]
        if not hits:
            tail = rest[pos:]
            items.append(Text(tail[: len(tail) - (0 if final else held(tail, opens))]))
            return items
        i, marker = min(hits)
        items.append(Text(rest[pos:i]))
        calls, end, ok = section(rest, i, tools, final)
        if calls:
            items += calls
            if end is None:
                for c in calls:
                    c.closed = c.closed or final
                return items
            pos = end
        elif ok and end is None and not final:
            return items  # not known yet: held back
        else:
            items.append(Text(marker))  # not a call: its marker is text, and so is the rest
            pos = i + len(marker)


def merge(items: list[Item]) -> list[Item]:
    out: list[Item] = []
    for x in items:
        last = out[-1] if out else None
        if isinstance(x, Text) and isinstance(last, Text):
            out[-1] = Text(last.text + x.text)
        elif isinstance(x, Think) and isinstance(last, Think):
            out[-1] = Think(last.text + x.text)
        else:
            out.append(x)
    return out


def xml_members(text: str, pos: int, tool: str, tools: Tools, param: re.Pattern[str],
                close: str, trim_newlines: bool = False) -> tuple[list[tuple[str, Any]], int]:
    """The complete parameters from `pos`: `param` matches a parameter's opening (group 1 its
    name), `close` ends its value. (members, the index after the last complete one)."""
    members: list[tuple[str, Any]] = []
    while True:
        m = param.match(text, skip_ws(text, pos))
        if not m:
            return members, pos
        j = text.find(close, m.end())
        if j < 0:
            return members, pos
        raw = text[m.end():j]
        if trim_newlines:
            raw = raw.removeprefix("\n").removesuffix("\n")
        members.append((m.group(1).strip(), tools.value(tool, m.group(1).strip(), raw)))
        pos = j + len(close)


def xml_call(text: str, start: int, name: str, tools: Tools, final: bool,
             param: re.Pattern[str], param_close: str, call_close: str,
             trim_newlines: bool = False) -> tuple[Call | None, int | None, bool]:
    """A call whose name is read and whose parameters start at `start`: (call or None while
    not reportable, index after `call_close` or None, False once it cannot be a call)."""
    if not tools.declared(name):
        return None, None, False
    members, pos = xml_members(text, start, name, tools, param, param_close, trim_newlines)
    k = skip_ws(text, pos)
    closed = text.startswith(call_close, k)
    end = k + len(call_close) if closed else None
    if not members and not closed:
        if final:
            return None, None, False
        rest = text[k:]
        maybe = any(p.startswith(rest[: len(p)]) for p in (call_close, "<"))
        return None, None, maybe or not rest
    return Call(name, members, closed=closed or final), end, True


def json_section(text: str, i: int, tools: Tools, final: bool, open_: str, call_open: str,
                 sep: str, call_close: str, close: str, name_of: Any
                 ) -> tuple[list[Call], int | None, bool]:
    """A section of calls `call_open NAME sep {json} call_close`, ended by `close` (DeepSeek,
    Kimi). `name_of` turns the text between call_open and sep into the tool name."""
    calls: list[Call] = []
    pos = i + len(open_)
    while True:
        k = skip_ws(text, pos)
        if text.startswith(close, k):
            return calls, k + len(close), bool(calls)
        if not text.startswith(call_open, k):
            rest = text[k:]
            if not final and (close.startswith(rest) or call_open.startswith(rest)):
                return calls, None, True
            return calls, (k if calls else None), False
        s = text.find(sep, k + len(call_open))
        if s < 0:
            return calls, None, not final
        name = name_of(text[k + len(call_open):s])
        e = text.find(call_close, s + len(sep))
        body = text[s + len(sep): e if e >= 0 else len(text)]
        call, ok, _ = json_call(name, body, final or e >= 0, tools)
        if call is not None:
            calls.append(call)
        if e < 0 or call is None:
            return calls, None, ok
        pos = e + len(call_close)
