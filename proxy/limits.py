"""Bounds on what one request may hold, checked at the edge before anything else reads it.

    load(raw, limits) -> body        the JSON body, parsed safely and walked once
    check_request(body, limits)      the fields both APIs share: messages, stop strings, tools

Rules:
- Every request body goes through here first (proxy/edge.py's `parse_body`, used by every
  handler that takes a body), so nothing past the edge meets a RecursionError, an integer
  too long to print, a lone surrogate or an unbounded list. Whatever breaks a bound is a
  `BadRequest` (400) whose message says where, the value, the limit and its name.
- The body is UTF-8 JSON (RFC 8259). `json.loads` accepts "\\ud800" (a lone surrogate, which
  no encoder accepts later) and NaN / Infinity (not JSON): both are refused here. Nesting
  deeper than the interpreter can parse is refused as too deep, not a 500.
- Bounds are generous for real agents: Claude Code sends ~20K-token system prompts, two dozen
  tools with big schemas and up to a few thousand messages; a 1M-token conversation is ~4 MB of
  JSON. They exist to keep hostile input from costing the proxy or a worker more than a real
  request does (and a tool schema's depth, which the grammar converter recurses on).
- Only shape and size are checked here; what a field means is the API parsers' business.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from proxy.errors import BadRequest


@dataclass(frozen=True, slots=True)
class Limits:
    # request body after Content-Encoding, bytes; 64 MiB (a 1M-token conversation is ~4 MB)
    max_body_bytes: int = 64 << 20
    # nesting of JSON objects and arrays, levels (the body itself is 1); 64
    max_depth: int = 64
    # digits of one JSON integer, sign excluded; 20 (every 64-bit value fits)
    max_int_digits: int = 20
    # one JSON string (or object key), characters; 8 Mi (a ~2M-token text)
    max_string_chars: int = 8 << 20
    # items of one JSON array, items; 100,000
    max_array_items: int = 100_000
    # entries of `messages`, messages; 20,000 (agents send up to a few thousand)
    max_messages: int = 20_000
    # entries of `stop` / `stop_sequences`, strings; 32
    max_stop_strings: int = 32
    # one stop string, characters; 512 (each generated token is matched against every one)
    max_stop_chars: int = 512
    # entries of `tools`, tools; 512 (Claude Code sends ~24, MCP-heavy agents a few hundred)
    max_tools: int = 512
    # one tool definition (name, description, schema) as compact JSON, bytes; 256 KiB
    max_tool_bytes: int = 256 << 10
    # nesting of one tool's parameter schema, levels (the schema object is 1); 32
    max_schema_depth: int = 32


LIMITS = Limits()


def with_overrides(pairs: tuple[str, ...], base: Limits = LIMITS) -> Limits:
    """`--limit NAME=VALUE` (repeatable): the defaults with these bounds replaced. Raises
    ValueError naming what is wrong."""
    names = Limits.__dataclass_fields__
    values: dict[str, int] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name.strip() not in names or not value.strip().isdigit():
            raise ValueError(f"--limit {pair!r}: use NAME=VALUE with a positive integer, NAME one "
                             f"of {', '.join(names)}")
        values[name.strip()] = int(value)
    return dataclasses.replace(base, **values)


_SURROGATE = re.compile("[\ud800-\udfff]")


def load(raw: bytes, limits: Limits = LIMITS) -> Any:
    """The parsed body, or a BadRequest naming the first bound it breaks (see the module rules).
    `raw` is at most max_body_bytes long: the server refuses longer bodies before this."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {e.start}): send UTF-8 "
                         "JSON") from None
    try:
        return parse(text, limits)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


def parse(text: str, limits: Limits = LIMITS, where: str = "") -> Any:
    """JSON text within the limits, for the body and for JSON a client sends inside a string
    (OpenAI's tool call arguments); `where` prefixes the paths in messages. Text that is not
    JSON raises json.JSONDecodeError; a bound broken, BadRequest."""
    try:
        value = json.loads(text, parse_int=_int_parser(limits, where),
                           parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"{where or 'the request body'} nests far deeper than "
                         f"{limits.max_depth} levels (limit max_depth)", param=where or None
                         ) from None
    _walk(value, limits, "\\ud" in text or "\\uD" in text, (where,) if where else ())
    return value


def check_request(body: Any, limits: Limits = LIMITS) -> None:
    """The bounds on fields both APIs share: messages, stop strings, tools and their schemas.
    A field of the wrong type is left to the API parser, which says what it must be."""
    if not isinstance(body, dict):
        return
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise BadRequest(f"'messages' has {len(messages)} messages; at most "
                         f"{limits.max_messages} are accepted (limit max_messages)",
                         param="messages")
    for name in ("stop", "stop_sequences"):
        _check_stops(body.get(name), name, limits)
    tools = body.get("tools")
    if isinstance(tools, list):
        if len(tools) > limits.max_tools:
            raise BadRequest(f"'tools' has {len(tools)} tools; at most {limits.max_tools} are "
                             "accepted (limit max_tools)", param="tools")
        for k, tool in enumerate(tools):
            _check_tool(tool, k, limits)


# --- parsing -------------------------------------------------------------------------------


def _int_parser(limits: Limits, where: str) -> Any:
    def parse_int(s: str) -> int:
        digits = len(s) - s.startswith("-")
        if digits > limits.max_int_digits:
            raise BadRequest(f"{where or 'the request body'} has an integer of {digits} digits; "
                             f"at most {limits.max_int_digits} are accepted (limit "
                             "max_int_digits)", param=where or None)
        return int(s)

    return parse_int


def _no_constant(name: str) -> Any:
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def _where(path: tuple[str | int, ...]) -> str:
    out = ""
    for p in path:
        if isinstance(p, str):  # a key may hold a lone surrogate: shown escaped
            p = p.encode("utf-8", "backslashreplace").decode()
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "request body"


def _check_string(s: str, path: tuple[str | int, ...], limits: Limits, surrogates: bool,
                  what: str = "") -> None:
    if len(s) > limits.max_string_chars:
        raise BadRequest(f"{_where(path)}{what} is {len(s)} characters long; at most "
                         f"{limits.max_string_chars} are accepted (limit max_string_chars)",
                         param=_where(path))
    if surrogates and (m := _SURROGATE.search(s)):
        raise BadRequest(f"{_where(path)}{what} has a lone surrogate ({ascii(m.group())}) at "
                         f"character {m.start()}: text must be valid Unicode (a surrogate only "
                         "as half of a pair)", param=_where(path))


def _walk(body: Any, limits: Limits, surrogates: bool, root: tuple[str | int, ...]) -> None:
    """Depth, string and array bounds over the whole body, without recursion. `surrogates`:
    whether the text has a \\uD... escape at all (if not, no string can hold one)."""
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(body, root, 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_string(value, path, limits, surrogates)
            continue
        if depth > limits.max_depth:
            raise BadRequest(f"{_where(path)} is nested {depth} levels deep; at most "
                             f"{limits.max_depth} are accepted (limit max_depth)",
                             param=_where(path))
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key, (*path, key), limits, surrogates, " (the key)")
                if isinstance(item, str | dict | list):
                    stack.append((item, (*path, key), depth + 1))
        elif isinstance(value, list):
            if len(value) > limits.max_array_items:
                raise BadRequest(f"{_where(path)} has {len(value)} items; at most "
                                 f"{limits.max_array_items} are accepted (limit "
                                 "max_array_items)", param=_where(path))
            for i, item in enumerate(value):
                if isinstance(item, str | dict | list):
                    stack.append((item, (*path, i), depth + 1))


# --- fields --------------------------------------------------------------------------------


def _check_stops(stops: Any, name: str, limits: Limits) -> None:
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list):
        return
    if len(stops) > limits.max_stop_strings:
        raise BadRequest(f"'{name}' has {len(stops)} strings; at most {limits.max_stop_strings} "
                         "are accepted (limit max_stop_strings)", param=name)
    for i, s in enumerate(stops):
        if isinstance(s, str) and len(s) > limits.max_stop_chars:
            raise BadRequest(f"{name}[{i}] is {len(s)} characters long; at most "
                             f"{limits.max_stop_chars} are accepted (limit max_stop_chars)",
                             param=name)


def _check_tool(tool: Any, k: int, limits: Limits) -> None:
    if not isinstance(tool, dict):
        return
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    label = f"tools[{k}]" + (f" ({fn['name']!r})" if isinstance(fn.get("name"), str) else "")
    size = len(json.dumps(tool, ensure_ascii=False, separators=(",", ":")).encode())
    if size > limits.max_tool_bytes:
        raise BadRequest(f"{label} is {size} bytes of JSON; at most {limits.max_tool_bytes} "
                         "are accepted (limit max_tool_bytes)", param=f"tools[{k}]")
    for field in ("parameters", "input_schema"):
        depth = _depth(fn.get(field))
        if depth > limits.max_schema_depth:
            raise BadRequest(f"{label}: its {field} schema nests {depth} levels deep; at most "
                             f"{limits.max_schema_depth} are accepted (limit max_schema_depth)",
                             param=f"tools[{k}]")


def _depth(value: Any) -> int:
    """Levels of objects and arrays in `value` (a scalar is 0)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest
