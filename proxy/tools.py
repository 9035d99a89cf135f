"""Tool calls for both APIs: tools into the prompt, tool calls out of the generated text.

Rules:
- Tools arrive OpenAI-shaped (`{"type": "function", "function": {name, description,
  parameters}}`); the Anthropic edge converts its `{name, description, input_schema}` to that.
  `tool_choice` is "auto", "none", "required" or `{"name": NAME}`.
- Into the prompt: a template that reads `tools` gets them as they are, and the messages keep
  `tool_calls` and `role: "tool"`. A template that does not (SmolLM2's reads only `role` and
  `content`) gets them in the Hermes convention, exactly as Qwen2.5's template writes it: a
  `# Tools` section with one JSON line per tool inside `<tools></tools>` appended to the first
  system message (created when absent); assistant tool calls become `<tool_call>\n{"name": ...,
  "arguments": {...}}\n</tool_call>` lines in the content; tool results become a user message
  of `<tool_response>\n...\n</tool_response>` blocks (consecutive results and a user message that
  follows them share one user message). The rendering depends only on the messages, so a
  conversation re-sent with one more turn renders its old turns to the same tokens.
- Out of the text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` with a declared
  tool's name is a call; anything else, a call that does not parse included, stays text.
  `ToolCallParser` does this incrementally for streams: text is passed on at once except a
  tail that may start `<tool_call>`, and a call is emitted whole when its closing tag arrives.
  Whitespace next to a call is dropped. With tool_choice "none" nothing is parsed.
- Forced calls ("required", named): a GBNF grammar from the tools' JSON schemas (llama.cpp's
  own converter) constrains sampling to exactly one `<tool_call>` block whose name is a declared
  tool (the named one) and whose arguments match its schema; a schema the converter cannot
  handle falls back to any JSON object. After the block, the grammar admits only end of turn.
  Length, item and pattern bounds above GRAMMAR_MAX_REPEAT are left out of the grammar (the
  converter unrolls them into as many nested groups: ~20,000 overflow llama.cpp's parser).
  The grammar is parsed here, by llama.cpp, before any worker sees it: one it cannot parse (a
  `$ref` to itself, an empty `enum` or `anyOf`, a `"` in a name) is a 400 naming the tool,
  never a NULL sampler in a worker.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import llama_cpp
from llama_cpp.llama_grammar import json_schema_to_gbnf

from proxy.errors import BadRequest

log = logging.getLogger("prefixgate")

OPEN, CLOSE = "<tool_call>", "</tool_call>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

_CALL_RULE = "pg-tool-call"  # the converter names rules after properties: keep this unusual
# larger minLength / maxLength / minItems / maxItems / pattern {n,m} bounds are not in a
# forced call's grammar (the prompt still shows them)
GRAMMAR_MAX_REPEAT = 1000
# deepest ( ) nesting parsed here; llama.cpp's recursive parser overflows an 8 MiB stack near
# 20,000 (a `"` in a name lets raw grammar through, so this holds whatever the converter does)
GRAMMAR_MAX_NESTING = 2000
_REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_DATA_KEYS = ("const", "enum", "default", "examples")
# what cannot open or close a group: literals, character classes, comments
_INERT = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')


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


def strip_schema_noise(value: Any) -> Any:
    """A JSON schema without `$schema` keys (Claude Code sends them; they carry no shape)."""
    if isinstance(value, dict):
        return {k: strip_schema_noise(v) for k, v in value.items() if k != "$schema"}
    if isinstance(value, list):
        return [strip_schema_noise(v) for v in value]
    return value


def apply(supports_tools: bool, messages: list[dict[str, Any]],
          tools: tuple[dict[str, Any], ...], choice: Any, tools_first: bool = False
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str | None]:
    """(messages, tools for the template, grammar) for one request: see the module rules."""
    grammar = call_grammar(tools, choice) if tools else None
    if supports_tools:
        return messages, list(tools) or None, grammar
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, None, None
    return hermes_messages(messages, tools, tools_first), None, grammar


def tools_section(tools: tuple[dict[str, Any], ...]) -> str:
    lines = [json.dumps(strip_schema_noise(t), ensure_ascii=False) for t in tools]
    return TOOLS_PREAMBLE + "".join("\n" + line for line in lines) + TOOLS_POSTAMBLE


def call_text(name: str, arguments: Any) -> str:
    return OPEN + "\n" + json.dumps({"name": name, "arguments": arguments},
                                    ensure_ascii=False) + "\n" + CLOSE


def hermes_messages(messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...],
                    tools_first: bool = False) -> list[dict[str, Any]]:
    """Messages for a template without tool support: everything tool-related becomes text.
    `tools_first`: the tools section before the system text (stable first), else after it."""
    out: list[dict[str, Any]] = []
    if tools:
        section = tools_section(tools)
        if messages and messages[0].get("role") == "system":
            first = messages[0]
            body = first.get("content") or ""
            parts = [section, body] if tools_first else [body, section]
            out.append({"role": "system", "content": "\n\n".join(p for p in parts if p)})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": section})
    from_tool = False  # the last message in `out` holds tool responses
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"].get("arguments", {}))
                     for c in m["tool_calls"]]
            content = m.get("content") or ""
            out.append({"role": "assistant",
                        "content": "\n".join([content, *calls] if content else calls)})
            from_tool = False
        elif role == "tool":
            block = "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"
            if from_tool:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
            from_tool = True
        elif role == "user" and from_tool:
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + m["content"]}
            from_tool = False
        else:
            out.append({"role": role, "content": m.get("content") or ""})
            from_tool = False
    return out


def call_grammar(tools: tuple[dict[str, Any], ...], choice: Any) -> str | None:
    """GBNF for exactly one call (to the named tool for {"name"}); None unless forced."""
    if choice == "required":
        chosen = list(tools)
    elif isinstance(choice, dict):
        chosen = [t for t in tools if t["function"]["name"] == choice["name"]]
    else:
        return None
    grammar = _grammar(chosen)
    error = grammar_error(grammar)
    if error is not None:
        bad = [t for t in chosen if grammar_error(_grammar([t])) is not None] or chosen
        names = ", ".join(repr(t["function"]["name"][:64]) for t in bad)
        raise BadRequest(
            f"tool {names}: its schema cannot be made into a grammar for a forced call (tool "
            f"choice required or named): llama.cpp's grammar parser says {error!r}. Common "
            "causes: a $ref to itself, an empty enum or anyOf, a '\"' in the tool name or a "
            "property name. Fix the schema, or let the model choose (tool choice auto).",
            param="tools")
    return grammar


def _grammar(chosen: list[dict[str, Any]]) -> str:
    alternatives = [_call_schema(t) for t in chosen]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    try:
        body = json_schema_to_gbnf(json.dumps(schema), prop_order=["name", "arguments"])
    except Exception as e:  # the converter does not cover every schema feature
        log.info("tool schema not convertible to a grammar (%.200s); forcing any JSON arguments",
                 e)
        loose = [_call_schema(t, loose=True) for t in chosen]
        schema = loose[0] if len(loose) == 1 else {"anyOf": loose}
        body = json_schema_to_gbnf(json.dumps(schema), prop_order=["name", "arguments"])
    body = body.replace("root ::=", f"{_CALL_RULE} ::=", 1)
    return f'root ::= "{OPEN}\\n" {_CALL_RULE} "\\n{CLOSE}"\n{body}'


_CHECKED: dict[bytes, str | None] = {}  # a grammar's SHA-256 -> grammar_error's answer
_CHECKED_MAX = 1024


def grammar_error(grammar: str) -> str | None:
    """None when llama.cpp's grammar parser accepts `grammar`, else what it says: the same parse
    a worker's grammar sampler does (no vocabulary is needed to parse), here in the proxy,
    where a refusal is a 400. Answers are remembered by digest: agents resend the same tools."""
    key = hashlib.sha256(grammar.encode()).digest()
    if key not in _CHECKED:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[key] = _parse_error(grammar)
    return _CHECKED[key]


def _parse_error(grammar: str) -> str | None:
    """Too deep a nesting is refused before it reaches llama.cpp's recursive parser."""
    depth = _nesting(grammar)
    if depth > GRAMMAR_MAX_NESTING:
        return f"groups nested {depth} deep (at most {GRAMMAR_MAX_NESTING} are parsed)"
    with tempfile.TemporaryFile() as said:
        with _stderr_to(said.fileno()):
            sampler = llama_cpp.llama_sampler_init_grammar(None, grammar.encode(), b"root")
        if sampler:
            llama_cpp.llama_sampler_free(sampler)
            return None
        said.seek(0)
        lines = said.read(4096).decode(errors="replace").splitlines()
    return (lines[0] if lines else "failed to parse grammar")[:160]


@contextlib.contextmanager
def _stderr_to(fd: int) -> Iterator[None]:
    """File descriptor 2 into `fd` meanwhile: on an error llama.cpp's parser prints the whole
    grammar there (up to megabytes a request). The log handlers are held meanwhile, so no
    other thread's log line goes to `fd` instead."""
    handlers = logging.getLogger().handlers
    for h in handlers:
        h.acquire()
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        for h in reversed(handlers):
            h.release()


def _nesting(grammar: str) -> int:
    """The deepest nesting of ( ) groups in GBNF."""
    bare = _INERT.sub("", grammar)
    steps = (1 if c == "(" else -1 for c in bare if c in "()")
    return max(itertools.accumulate(steps), default=0)


def _call_schema(tool: dict[str, Any], loose: bool = False) -> dict[str, Any]:
    fn = tool["function"]
    params = _without_big_repeats(strip_schema_noise(fn.get("parameters") or {"type": "object"}))
    if loose or not isinstance(params, dict):
        params = {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"]}


def _without_big_repeats(value: Any) -> Any:
    """A schema without length, item or pattern bounds above GRAMMAR_MAX_REPEAT (see the module
    rules); values (const, enum, default, examples) are kept as they are."""
    if isinstance(value, dict):
        return {k: v if k in _DATA_KEYS else _without_big_repeats(v)
                for k, v in value.items() if not _big_repeat(k, v)}
    if isinstance(value, list):
        return [_without_big_repeats(v) for v in value]
    return value


def _big_repeat(key: str, value: Any) -> bool:
    if key == "pattern" and isinstance(value, str):  # a{n}, a{n,m}: unrolled like maxLength
        bounds = (b for m in _QUANTIFIER.finditer(value) for b in m.groups() if b)
        return any(len(b) > 6 or int(b) > GRAMMAR_MAX_REPEAT for b in bounds)
    return key in _REPEAT_KEYS and isinstance(value, int) and value > GRAMMAR_MAX_REPEAT


# --- the response side ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCall:
    id_hex: str  # the API prefixes it: call_..., toolu_...
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def parse_call(body: str, names: frozenset[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, an integer too long, nested too deep
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(uuid.uuid4().hex[:24], obj["name"], args)


class ToolCallParser:
    """Splits generated text into text pieces and ToolCalls (see the module rules)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.calls = 0
        self._buf = ""
        self._in_call = False
        self._ws = ""  # trailing whitespace held back: dropped before a call
        self._after_call = False  # leading whitespace after a call is dropped too

    def feed(self, piece: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self._buf += piece
        while True:
            if self._in_call:
                j = self._buf.find(CLOSE)
                if j < 0:
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(CLOSE):]
                self._in_call = False
                call = parse_call(body.strip(), self.names)
                if call is None:
                    self._text(OPEN + body + CLOSE, out)
                else:
                    self._ws = ""
                    self._after_call = True
                    self.calls += 1
                    out.append(call)
                continue
            i = self._buf.find(OPEN)
            if i >= 0:
                self._text(self._buf[:i], out)
                self._buf = self._buf[i + len(OPEN):]
                self._in_call = True
                continue
            keep = _partial_tag_len(self._buf)
            self._text(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        rest = (OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        self._text(rest, out)
        if self._ws and not self.calls:
            out.append(self._ws)
        self._ws = ""
        return out

    def _text(self, s: str, out: list[str | ToolCall]) -> None:
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body):]
        if self._after_call:
            body = body.lstrip()
        if body:
            self._after_call = False
            out.append(body)


def _partial_tag_len(s: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of the opening tag."""
    for n in range(min(len(s), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(s[-n:]):
            return n
    return 0


def parser_for(tools: tuple[dict[str, Any], ...], choice: Any) -> ToolCallParser | None:
    """A tool-call parser when the request declared tools and did not say tool_choice none."""
    if not tools or choice == "none":
        return None
    return ToolCallParser(tool_names(tools))


async def output(pieces: AsyncIterator[str], tools: tuple[dict[str, Any], ...], choice: Any
                 ) -> AsyncIterator[str | ToolCall]:
    """Generated text pieces, with tool calls parsed out when tools are in play."""
    parser = parser_for(tools, choice)
    async for piece in pieces:
        if parser is None:
            yield piece
            continue
        for item in parser.feed(piece):
            yield item
    if parser is not None:
        for item in parser.finish():
            yield item
