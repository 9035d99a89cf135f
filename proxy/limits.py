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

import bisect
import dataclasses
import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from policies.prefix import common_prefix_len
from proxy.errors import BadRequest
from proxy.memo import IdMemo


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
    `raw` is at most max_body_bytes long: the server refuses longer bodies before this.
    A body that repeats a recent one's text up to some message reuses what was parsed of it
    (`_Recent`)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {e.start}): send UTF-8 "
                         "JSON") from None
    if len(text) <= limits.max_string_chars and limits.max_depth >= 3:
        body = _RECENT.load(text, limits)
        if body is not None:
            return body
    try:
        return parse(text, limits)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


class _Parsed:
    """A body parsed with the spans of its top-level values and of the messages."""

    __slots__ = ("text", "limits", "body", "spans", "messages")

    def __init__(self, text: str, limits: Limits) -> None:
        self.text = text
        self.limits = limits
        self.body: dict[str, Any] = {}
        self.spans: dict[str, tuple[int, int]] = {}  # top-level key -> its value's span
        self.messages: list[tuple[int, int, Any]] = []  # (start, end, value) per message


_WS = re.compile(r"[ \t\n\r]*")


class _Recent:
    """The last bodies parsed, so that the next turn of a conversation (the same text up to its
    new messages: agents re-send the history byte for byte) parses only what is new. A value is
    reused when its whole text lies in the part both bodies share, so it is the value the
    parser would make of it again, and it met the bounds then; a reused message is the same
    object as before (later stages remember their work by it). The text is parsed with the
    json module's own scanner, value by value; anything unusual (not an object, a duplicate
    key, a lone surrogate escape, a string longer than the bounds allow) takes the plain
    path, and so does anything that fails, which then says why.

    A body replaces the one it resumed only when it repeats all of that one's messages (the
    next turn of the same conversation, or a retry): one that shares less with it (another
    session whose system prompt differs in its last line, a title call, a subagent: any two
    bodies share at least their first key) is kept beside it, so sessions that take turns each
    find their own last body and resume as a lone session does. At most `max_bodies` bodies
    and `max_chars` characters are kept, the least recently used dropped first."""

    def __init__(self, max_bodies: int = 8, max_chars: int = 64 << 20) -> None:
        self.max_bodies = max_bodies
        self.max_chars = max_chars
        self._bodies: list[_Parsed] = []
        self._lock = threading.Lock()

    def load(self, text: str, limits: Limits) -> dict[str, Any] | None:
        with self._lock:
            candidates = [b for b in self._bodies if b.limits is limits]
        best, shared = None, 0
        for old in reversed(candidates):  # the newest first: likely this conversation's
            if shared and (len(old.text) <= shared or old.text[shared] != text[shared:shared + 1]):
                continue  # it cannot share more than the best so far
            n = common_prefix_len(text, old.text)
            if n > shared:
                best, shared = old, n
        # a lone surrogate escape takes the plain path; a remembered text has none
        after = max(shared - 2, 0)
        if text.find("\\ud", after) >= 0 or text.find("\\uD", after) >= 0:
            return None
        try:
            parsed = _parse_top(text, limits, best if shared else None, shared)
        except Exception:  # noqa: BLE001 - the plain path raises the error the client sees
            return None
        if parsed is None:
            return None
        with self._lock:
            kept = [b for b in self._bodies if b is not best]
            if best is not None and not _repeats(best, shared):
                kept.append(best)  # another conversation's: kept, as just used
            self._bodies = [*kept[-(self.max_bodies - 1):], parsed]
            while sum(len(b.text) for b in self._bodies) > self.max_chars and self._bodies:
                self._bodies.pop(0)
        return parsed.body


_RECENT = _Recent()


def _repeats(old: _Parsed, shared: int) -> bool:
    """Whether a body that shares `shared` characters with `old` repeats all of its messages
    (all of its text when it has none)."""
    return shared >= (old.messages[-1][1] if old.messages else len(old.text))


def _parse_top(text: str, limits: Limits, old: _Parsed | None, shared: int) -> _Parsed | None:
    """`text` parsed as an object with its spans, reusing `old`'s values that end within the
    first `shared` characters; None when it is not an object this handles."""
    scan = _decoder(limits).scan_once
    out = _Parsed(text, limits)
    ws = _WS.match
    i = ws(text, 0).end()
    if text[i : i + 1] != "{":
        return None
    i = ws(text, i + 1).end()
    fresh: list[Any] = []  # values parsed now: they get the bounds' walk
    if text[i : i + 1] == "}":
        i += 1
    else:
        while True:
            if text[i : i + 1] != '"':
                return None
            key, i = json.decoder.scanstring(text, i + 1)
            i = ws(text, i).end()
            if text[i : i + 1] != ":" or key in out.body:
                return None
            i = ws(text, i + 1).end()
            start = i
            if key == "messages" and text[i : i + 1] == "[":
                value, i = _parse_messages(text, i, scan, out, old, shared, fresh)
            else:
                span = old.spans.get(key) if old is not None else None
                if span is not None and span[0] == start and span[1] <= shared:
                    value, i = old.body[key], span[1]
                elif (span is not None and old is not None and text[i : i + 1] in '{["'
                        and old.text[span[0]:span[1]] == text[i : i + span[1] - span[0]]):
                    # the same text at another offset (after new messages): an object, array
                    # or string ends where its text does, so it is the same value
                    value, i = old.body[key], i + span[1] - span[0]
                else:
                    value, i = scan(text, i)
                    fresh.append(value)
            out.body[key] = value
            out.spans[key] = (start, i)
            i = ws(text, i).end()
            if text[i : i + 1] == ",":
                i = ws(text, i + 1).end()
                continue
            if text[i : i + 1] != "}":
                return None
            i += 1
            break
    if ws(text, i).end() != len(text):
        return None
    if not all(_within(v, limits, 2) for v in fresh):
        return None
    return out


def _parse_messages(text: str, i: int, scan: Any, out: _Parsed, old: _Parsed | None,
                    shared: int, fresh: list[Any]) -> tuple[list[Any], int]:
    """The messages array at `text[i]` ("["), its items reused from `old` while they lie in
    the shared text at the same offsets."""
    ws = _WS.match
    items: list[Any] = []
    before = old.messages if old is not None and old.spans.get("messages", (-1,))[0] == i \
        else []
    i = ws(text, i + 1).end()
    if text[i : i + 1] == "]":
        return items, i + 1
    k = bisect.bisect_right(before, shared, key=lambda m: m[1])  # those wholly shared
    if k and before[0][0] == i:  # the same text up to the end of message k - 1
        out.messages += before[:k]
        items += [value for _, _, value in before[:k]]
        i = ws(text, before[k - 1][1]).end()
        if text[i : i + 1] == ",":
            i = ws(text, i + 1).end()
        else:
            k = len(items) - 1  # the array ends there: take the last item's turn below
            del out.messages[-1], items[-1]
            i = before[k][0]
    else:
        k = 0
    while True:
        if k < len(before) and before[k][0] == i and before[k][1] <= shared:
            _, end, value = before[k]
        else:
            value, end = scan(text, i)
            if not _within(value, out.limits, 3):
                raise ValueError("a bound is broken: the plain path says where")
        out.messages.append((i, end, value))
        items.append(value)
        k += 1
        i = ws(text, end).end()
        if text[i : i + 1] == ",":
            i = ws(text, i + 1).end()
            continue
        if text[i : i + 1] != "]":
            raise ValueError("not an array")
        if len(items) > out.limits.max_array_items:
            raise ValueError("too many items: the plain path says so")
        return items, i + 1


def parse(text: str, limits: Limits = LIMITS, where: str = "") -> Any:
    """JSON text within the limits, for the body and for JSON a client sends inside a string
    (OpenAI's tool call arguments); `where` prefixes the paths in messages. Text that is not
    JSON raises json.JSONDecodeError; a bound broken, BadRequest."""
    try:
        value = _decoder(limits).decode(text)
    except RecursionError:
        raise BadRequest(f"{where or 'the request body'} nests far deeper than "
                         f"{limits.max_depth} levels (limit max_depth)", param=where or None
                         ) from None
    except _LongInt as e:
        raise BadRequest(f"{where or 'the request body'} has an integer of {e.digits} digits; "
                         f"at most {limits.max_int_digits} are accepted (limit "
                         "max_int_digits)", param=where or None) from None
    surrogates = "\\ud" in text or "\\uD" in text
    if surrogates or len(text) > limits.max_string_chars or not _within(value, limits):
        _walk(value, limits, surrogates, (where,) if where else ())
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
        for k, (tool, passed) in enumerate(zip(tools, _CHECKED.get_many(tools), strict=True)):
            if passed is not limits:  # a tool object re-sent (reused by `load`) passed before
                _check_tool(tool, k, limits)
                _CHECKED.put(tool, limits)


_CHECKED = IdMemo(1024)  # a tool object -> the bounds it met


# --- parsing -------------------------------------------------------------------------------


class _LongInt(Exception):
    def __init__(self, digits: int) -> None:
        self.digits = digits


@functools.cache
def _decoder(limits: Limits) -> json.JSONDecoder:
    """One decoder per set of bounds (making one costs more than decoding a tool call's
    arguments)."""
    def parse_int(s: str) -> int:
        digits = len(s) - s.startswith("-")
        if digits > limits.max_int_digits:
            raise _LongInt(digits)
        return int(s)

    return json.JSONDecoder(parse_int=parse_int, parse_constant=_no_constant)


def _within(value: Any, limits: Limits, depth0: int = 1) -> bool:
    """Whether `value`, at nesting level `depth0`, keeps its nesting and arrays within the
    bounds, level by level (strings need no look: the caller knows none can be too long or
    hold a lone surrogate). False sends the caller to `_walk`, which finds the first bound
    broken and says where."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = depth0 - 1
    while level:
        depth += 1
        if depth > limits.max_depth:
            return False
        below = []
        for v in level:
            if type(v) is dict:
                below += [x for x in v.values() if type(x) is dict or type(x) is list]
            elif len(v) > limits.max_array_items:
                return False
            else:
                below += [x for x in v if type(x) is dict or type(x) is list]
        level = below
    return True


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
