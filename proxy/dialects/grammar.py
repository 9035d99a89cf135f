"""GBNF for forced tool calls (tool_choice required, any, or a named tool), in pieces a
dialect assembles into its own call format.

Rules:
- A JSON value (arguments, one parameter) comes from llama.cpp's own schema converter; its rules
  are renamed with a prefix so several schemas share one grammar. A schema the converter cannot
  handle falls back to any JSON object (arguments) or any JSON value (a parameter).
- Length, item and pattern bounds above GRAMMAR_MAX_REPEAT are left out (the converter unrolls
  them into as many nested groups: ~20,000 overflow llama.cpp's parser); the prompt still shows
  them.
- A string parameter of an XML dialect is bare text that does not contain `</` (the value's
  closing tag starts so), within its minLength / maxLength; a string enum or const is one of
  its words, bare.
- Every grammar is parsed here, by llama.cpp, before any worker sees it: one it cannot parse
  (a `$ref` to itself, an empty `enum` or `anyOf`, a `"` in a name) is a 400 naming the tool,
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
from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp
from llama_cpp.llama_grammar import json_schema_to_gbnf

from proxy.errors import BadRequest

log = logging.getLogger("prefixgate")

GRAMMAR_MAX_REPEAT = 1000
# deepest ( ) nesting parsed here; llama.cpp's recursive parser overflows an 8 MiB stack near
# 20,000 (a `"` in a name lets raw grammar through, so this holds whatever the converter does)
GRAMMAR_MAX_NESTING = 2000
_REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_DATA_KEYS = ("const", "enum", "default", "examples")
# what cannot open or close a group: literals, character classes, comments
_INERT = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')
_RULE = re.compile(r"^([a-zA-Z0-9-]+) ::=", re.M)
_NAME = re.compile(r"[a-zA-Z0-9-]+")

# bare text without "</": an XML dialect's string value
XML_TEXT = 'pg-xml-text ::= ([^<] | "<" [^/])*\n'


def literal(s: str) -> str:
    """A GBNF string literal for s."""
    return json.dumps(s, ensure_ascii=False)


def strip_schema_noise(value: Any) -> Any:
    """A JSON schema without `$schema` keys (Claude Code sends them; they carry no shape)."""
    if isinstance(value, dict):
        return {k: strip_schema_noise(v) for k, v in value.items() if k != "$schema"}
    if isinstance(value, list):
        return [strip_schema_noise(v) for v in value]
    return value


def params_of(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters") or {"type": "object"}
    params = clean_schema(params)
    return params if isinstance(params, dict) else {"type": "object"}


def clean_schema(schema: Any) -> Any:
    """A schema as grammars are made from it: no `$schema` keys, no bounds above
    GRAMMAR_MAX_REPEAT (see the module rules)."""
    return _without_big_repeats(strip_schema_noise(schema))


def json_rule(schema: Any, prefix: str, fallback: Any) -> tuple[str, str]:
    """(rule name, rules) matching one JSON value of `schema`."""
    try:
        body = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter does not cover every schema feature
        log.info("tool schema not convertible to a grammar (%.200s); forcing any JSON", e)
        body = json_schema_to_gbnf(json.dumps(fallback))
    return prefix + "root", _prefixed(body, prefix)


def _prefixed(body: str, prefix: str) -> str:
    """Every rule of `body` renamed prefix + name (references too, not inside literals)."""
    names = set(_RULE.findall(body))
    out, last = [], 0
    for m in _INERT.finditer(body):
        out.append(_rename(body[last:m.start()], names, prefix))
        out.append(m.group())
        last = m.end()
    out.append(_rename(body[last:], names, prefix))
    return "".join(out).rstrip("\n") + "\n"


def _rename(s: str, names: set[str], prefix: str) -> str:
    return _NAME.sub(lambda m: prefix + m.group() if m.group() in names else m.group(), s)


def args_rule(tool: dict[str, Any], prefix: str) -> tuple[str, str]:
    """(rule, rules) for a tool's arguments as one JSON object."""
    return json_rule(params_of(tool), prefix, {"type": "object"})


def calls(tools: list[dict[str, Any]], head: Callable[[str], str], tail: str,
          args: Callable[[dict[str, Any], str], tuple[str, str]] = args_rule
          ) -> tuple[str, list[str]]:
    """(root expression, rules) for one call to one of `tools`, each written `head(name)`,
    its arguments (`args(tool, rule prefix)`: JSON by default), then `tail`."""
    exprs, rules = [], []
    for n, t in enumerate(tools):
        rule, body = args(t, f"pg{n}-")
        end = f" {literal(tail)}" if tail else ""
        exprs.append(f"{literal(head(t['function']['name']))} {rule}{end}")
        rules.append(body)
    return "(" + " | ".join(exprs) + ")", rules


def xml_args(param: Callable[[str], tuple[str, str]]
             ) -> Callable[[dict[str, Any], str], tuple[str, str]]:
    """`args` for `calls` in an XML dialect: the parameters in the schema's order, the required
    ones required, each written `param(name)` = (its opening text, its closing text) around
    its value: bare text for a string, one of the words of a string enum, else a JSON value."""

    def args(tool: dict[str, Any], prefix: str) -> tuple[str, str]:
        params = params_of(tool)
        props = params.get("properties")
        props = props if isinstance(props, dict) else {}
        required = set(params.get("required") or ())
        parts, rules = [], []
        for n, (name, schema) in enumerate(props.items()):
            words = _string_choices(schema)
            if words is not None:
                value = "(" + " | ".join(literal(w) for w in words) + ")"
            elif isinstance(schema, dict) and schema.get("type") == "string":
                value = _xml_text(schema)
            else:
                value, body = json_rule(schema, f"{prefix}p{n}-", {})
                rules.append(body)
            open_, close = param(name)
            piece = f"{literal(open_)} {value} {literal(close)}"
            parts.append(piece if name in required else f"({piece})?")
        rule = f"{prefix}params"
        rules.append(f"{rule} ::= {' '.join(parts) or literal('')}\n")
        return rule, "".join(rules)

    return args


def _xml_text(schema: dict[str, Any]) -> str:
    """Bare text, within the schema's length bounds (those above GRAMMAR_MAX_REPEAT are gone);
    bounded text holds no `<`, so that every repetition is one character."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if not isinstance(lo, int) and not isinstance(hi, int):
        return "pg-xml-text"
    lo = lo if isinstance(lo, int) else 0
    return f'[^<]{{{lo},{hi if isinstance(hi, int) else ""}}}'


def _string_choices(schema: Any) -> list[str] | None:
    """The words of a string enum or const, else None."""
    if not isinstance(schema, dict):
        return None
    words = schema.get("enum") if "const" not in schema else [schema["const"]]
    if isinstance(words, list) and words and all(isinstance(w, str) for w in words):
        return words
    return None


def assemble(root: str, rules: list[str]) -> str:
    """The grammar `root ::= root` plus rules (and the bare-text rule where one uses it)."""
    body = "".join(rules)
    used = "pg-xml-text" in root or "pg-xml-text" in body
    return f"root ::= {root}\n" + (XML_TEXT if used else "") + body


def refusal(tools: list[dict[str, Any]], error: str) -> BadRequest:
    """The 400 for a forced call whose grammar llama.cpp refuses, naming the tools at fault."""
    names = ", ".join(repr(t["function"]["name"][:64]) for t in tools)
    return BadRequest(
        f"tool {names}: its schema cannot be made into a grammar for a forced call (tool "
        f"choice required or named): llama.cpp's grammar parser says {error!r}. Common "
        "causes: a $ref to itself or a cycle of $refs, an empty enum or anyOf, a '\"' in a "
        "property name. Fix the schema, or let the model choose (tool choice auto).",
        param="tools")


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
