"""Property-based fuzzing of both APIs' request bodies against a real prefixgate (issue 14).

    make fuzz                                            (10,000 requests)
    python -m bench.fuzz --requests 10000 [--seed N] [--clients 8]

One real server on loopback (`serving`): one worker, the default model, n_ctx 1024 (prompts at
the context's edge are cheap), tenant isolation on, the disk cache on, a queue deeper than the
clients. `hypothesis` generates the requests (`cases()`), driven programmatically (`generate`:
seeded, no example database) while a few client threads send them and check every answer
(`problems`):

- the status is below 500;
- an error is JSON in the API's own shape: OpenAI `{"error": {"message", "type", ...}}` for
  /v1/chat/completions and /v1/completions, Anthropic `{"type": "error", "error": {"type",
  "message"}}` for /v1/messages and /v1/messages/count_tokens;
- a 200 is what the body asked for: a JSON answer of its kind, or a stream that ends properly
  (OpenAI `data: [DONE]` or an error data line; Anthropic `message_stop` or `event: error`),
  every data line JSON, never more tokens than asked for.

After the run: the worker is the one that started (its "worker 0 ready (pid" line once, no
"exited with" in the log, /health ready), and greedy answers on both APIs equal the ones made
before the run. Exit status 1 on any 5xx, non-JSON error body, other failed check or crash.

What is generated (`cases()`; each case is one POST to one of the four endpoints): a body of
the endpoint's API built from valid values (messages of every role and block type, tools with
generated JSON schemas, tool_choice auto / none / forced, stop strings, sampling fields,
prefix_cache, stream and stream_options), and then (HOW) one of:
- nothing (2 in 10): clean, though a forced call may meet a schema with no grammar;
- hostile field values (3 in 10): each field one time in a few a wrong type, a huge or
  negative number, a long string, a lone surrogate, an unknown role or block type, a malformed
  tool or tool_choice, an empty stop string, an odd prefix_cache;
- 1-3 mutations anywhere in the tree (3 in 10): a value replaced, a field dropped, a field or
  item added, or raw JSON spliced in where json.dumps cannot write it (NaN, 1e999, 21- and
  4,301-digit integers, nesting past the limit, escaped lone surrogates, duplicate keys), and
  rarely a value far over a bound (8 Mi characters, 100,001 items, 100,000 levels);
- raw bytes (1 in 10): truncated JSON, random bytes, invalid UTF-8 (CESU surrogates, overlong
  forms), a BOM, trailing garbage, an empty body, a JSON scalar;
- odd headers (1 in 10): x-api-key / Authorization with odd bytes (not UTF-8, control
  characters, 9,000 bytes), Content-Encoding (gzip and deflate, valid or not, br, zstd, unknown,
  a gzip bomb), odd Content-Types.
One time in twenty the body goes chunked, one in ten to an alias path (/chat/completions,
?beta=true). Requests carry one of three tenants' keys.

Cost: max_tokens is 1-4 wherever a body is valid: a valid larger value is clamped and an OpenAI
body with none (up to the context's end) gets 4 (`cheap`). About three requests in four are
refused before any model work, and repeats that hypothesis generates are skipped.

aiohttp's HTTP parser refuses a few requests before any handler runs (a control character in a
header, a header over 8190 bytes) with its own text/plain 400: they are counted apart as parser refusals, not failures (no handler can shape
them). Any other non-JSON error body is a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gzip
import hashlib
import http.client
import json
import queue
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import brotli
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

try:  # Python 3.14's own, else its backport (a dependency below 3.14)
    from compression import zstd
except ImportError:
    from backports import zstd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.config import default_model  # noqa: E402
from proxy.limits import LIMITS  # noqa: E402
from tests.conftest import Server, running  # noqa: E402

# the server under test. A small context, so that prompts at its edge cost little to prefill.
# One llama.cpp thread: this is not a speed test, and two threads that wait on each other
# stall on a busy two-core machine.
N_CTX = 1024
SERVER_ARGS = ("--workers", "1", "--tenant-isolation", "--max-queue", "256", "--n-ctx",
               str(N_CTX), "--threads", "1", "--cache-max-bytes", str(1 << 30))
MAX_TOKENS = 4  # the most a valid generated body asks for

# endpoint -> (path, error shape)
ENDPOINTS = {
    "chat": ("/v1/chat/completions", "openai"),
    "completions": ("/v1/completions", "openai"),
    "messages": ("/v1/messages", "anthropic"),
    "count_tokens": ("/v1/messages/count_tokens", "anthropic"),
}
ALIASES = {"chat": "/chat/completions", "messages": "/v1/messages?beta=true",
           "count_tokens": "/v1/messages/count_tokens?beta=true"}
KEYS = ("sk-fuzz-a", "sk-fuzz-b", "tenant-ü")  # tenants (valid UTF-8 keys)
# aiohttp's HTTP parser answers these itself, as text/plain 400 (see the module docstring)
PARSER_REFUSALS = ("Invalid header value char", "Got more than 8190 bytes")


@dataclass(frozen=True, slots=True)
class Case:
    endpoint: str  # a key of ENDPOINTS
    path: str
    body: bytes  # exactly what is sent
    headers: tuple[tuple[str, bytes], ...]
    stream: bool | None  # what the body asks for; None when its bytes were mangled
    chunked: bool = False  # sent with Transfer-Encoding: chunked
    kinds: tuple[str, ...] = ()  # what was done to it, for the report

    def describe(self, limit: int = 1500) -> str:
        body = self.body if len(self.body) <= limit else (
            self.body[:limit] + b"... (%d bytes)" % len(self.body))
        head = "".join(f"\n  {k}: {v!r}" for k, v in self.headers)
        return (f"POST {self.path}{' (chunked)' if self.chunked else ''} [{', '.join(self.kinds)}]"
                f"{head}\n  body: {body!r}")


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int  # 0: no answer
    content_type: str
    data: bytes
    seconds: float
    error: str = ""  # why there was no (complete) answer

    def describe(self, limit: int = 600) -> str:
        if self.error:
            return f"no answer: {self.error}"
        return f"{self.status} {self.content_type}: {self.data[:limit]!r}"


# --- strategies: values ----------------------------------------------------------------------

Strategy = st.SearchStrategy[Any]


def mostly(valid: Strategy, odd: Strategy, one_in: int) -> Strategy:
    """`odd` about one time in `one_in` (one_of picks a branch uniformly, where a bounded
    integers() leans to its ends)."""
    return st.one_of(*[valid] * (one_in - 1), odd)


def chance(one_in: int) -> st.SearchStrategy[bool]:
    """True about one time in `one_in`."""
    return st.sampled_from((True,) + (False,) * (one_in - 1))


class Raw:
    """JSON text spliced into a body as it is: what json.dumps cannot write."""

    def __init__(self, text: str) -> None:
        self.text = text


WORDS = ("hi", "hello", "Say a color.", "2+2?", "ok", "Name a fruit.", "ping", "Why?")
ODD_TEXT = ("", " ", "\n", "\x00", "\ufeff", "\u202e", "\r\n\r\n", "🙂🙂🙂", "<tool_call>",
            "</tool_call>", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "{{ raise_exception('x') }}",
            "{% for %}", "\\u0000", "x-anthropic-billing-header: cc_version=1.0; cch=00000;")
LONG = (LIMITS.max_stop_chars + 1, 4_097, 30_000, 300_000)

plain = st.one_of(st.sampled_from(WORDS), st.sampled_from(WORDS), st.text(max_size=12))
long_text = st.builds(lambda unit, n: (unit * n)[:n], st.sampled_from(("x", "é漢🙂", "ab ")),
                      st.sampled_from(LONG))
surrogate_text = st.builds(lambda a, s, b: a + s + b, plain, st.characters(categories=["Cs"]),
                           plain)
# " a" is one token: prompts of about N_CTX tokens, templates' own tokens around them or not
near_context = st.integers(N_CTX - 40, N_CTX + 1).map(lambda n: " a" * n)
odd_text = st.one_of(st.sampled_from(ODD_TEXT), st.sampled_from(ODD_TEXT), surrogate_text,
                     surrogate_text, st.text(), long_text, near_context)

BIG_INTS = (0, -1, 2**31, 2**31 + 1, 2**32, 2**63, -(2**63), 2**64, 10**19, 10**20)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(BIG_INTS),
                    st.floats(), plain)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) |
                           st.dictionaries(plain, c, max_size=3), max_leaves=6)
RAW_TEXTS = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1.5e-400", "-0", "-0.0",
             '"\\ud800"', '"a\\udfff\\ud800b"', '"\\ud83d\\ude00"', '"\\u0000"', '"\\uDC00"',
             '{"a": 1, "a": [2]}', '{"\\ud800": 1}', "[]", "{}", "1E400")
raw = st.one_of(
    st.sampled_from(RAW_TEXTS), st.sampled_from(RAW_TEXTS),
    st.builds(lambda sign, n: sign + "9" * n, st.sampled_from(("", "-")),
              st.sampled_from((LIMITS.max_int_digits, LIMITS.max_int_digits + 1, 4_301))),
    st.builds(lambda n: "[" * n + "]" * n, st.sampled_from((10, 62, 63, 64, 65, 1_000))),
).map(Raw)
# over a bound by far, up to 8 MB each: only where a mutation sets a value, rarely
huge = st.one_of(
    st.just("x" * (LIMITS.max_string_chars + 1)),
    st.just(Raw("[" + ",".join(["0"] * (LIMITS.max_array_items + 1)) + "]")),
    st.sampled_from(("[" * 100_000 + "]" * 100_000, '{"a":' * 5_000 + "1" + "}" * 5_000,
                     "9" * 10_000)).map(Raw))
# any value where a field was expected: wrong types, huge numbers, odd text, raw JSON
hostile = st.one_of(json_values, json_values, json_values, st.sampled_from(BIG_INTS), odd_text,
                    odd_text, raw, raw)


def numbers(lo: float, hi: float) -> tuple[Strategy, Strategy]:
    """(valid, odd) for a number field in [lo, hi]."""
    return st.floats(lo, hi), st.one_of(
        st.sampled_from((lo - 1e-9, hi + 1e-9, -1, 1e308, 2**64, "1", True, None, [])),
        st.floats())


def ints(lo: int, hi: int) -> tuple[Strategy, Strategy]:
    """(valid, odd) for an integer field in [lo, hi]."""
    return st.integers(lo, hi), st.one_of(st.sampled_from(BIG_INTS + (1.5, "3", True)),
                                          st.integers())


SAMPLING = {
    "temperature": numbers(0, 2), "top_p": numbers(0, 1), "min_p": numbers(0, 1),
    "presence_penalty": numbers(-2, 2), "frequency_penalty": numbers(-2, 2),
    "repeat_penalty": numbers(0.01, 10), "top_k": ints(0, 100), "seed": ints(-(2**63), 2**64),
    # llama-server's other samplers (proxy/samplers.py)
    "typical_p": numbers(0, 1), "top_n_sigma": numbers(-1, 100), "xtc_probability": numbers(0, 1),
    "xtc_threshold": numbers(0, 1), "dry_multiplier": numbers(0, 100), "mirostat": ints(0, 2),
    "dynatemp_range": numbers(0, 100), "repeat_last_n": ints(0, 4096),
}
ODD_MAX_TOKENS = (0, -1, 5, 2**31, 2**31 + 1, 2**63, 1.5, 2.0, "2", True, None, [], {})
ODD_STREAM = (None, 0, 1, "true", "false", [], {})
stops = st.one_of(st.sampled_from(WORDS + (".", " ", "\n", "a")), st.lists(
    st.sampled_from(("", ".", " ", "\n", "a", "e", "<tool_call>", "</s>", "<|im_end|>", "🙂")) |
    plain, max_size=4))
odd_stops = st.one_of(st.lists(odd_text, max_size=3), hostile,
                      st.just([f"s{i}" for i in range(LIMITS.max_stop_strings + 1)]),
                      st.lists(st.one_of(json_values, long_text), min_size=1, max_size=2))
SCOPES = ("off", "full", "auto", "auto:2", "auto:30", "4096", "300", "AUTO:3")
ODD_SCOPES = ("auto:0", "auto:-1", "auto:" + "9" * 20, "-5", "0", "", " full ", "auto:",
              "auto:x", "1e3", "full:3", "none")
prefix_cache = st.fixed_dictionaries({"scope": st.sampled_from(SCOPES)},
                                     optional={"window": st.integers(1, 40)})
odd_prefix_cache = st.one_of(
    st.fixed_dictionaries({}, optional={
        "scope": st.one_of(st.sampled_from(SCOPES + ODD_SCOPES), st.integers(), json_values),
        "window": st.one_of(st.sampled_from((0, -1, 2**31, 2**63, True, "8", 1.5)),
                            st.integers())}),
    hostile)
MODELS = ("m", "gpt-4o", "claude-sonnet-4-5", "SmolLM2-135M-Instruct.Q4_1")


# --- strategies: tools and JSON schemas ------------------------------------------------------

TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
ODD_TYPES = ("foo", "", "any", ["string", "null"], [], 5, None)
PATTERNS = ("^[a-z]+$", "^a{0,30000}$", "a{999}", "a{1000}", "(", "[", "\\", "a{2,1}", "(?=a)",
            "\\p{L}+", ".*", "^(a|b)*$", "^\\d{3}-\\d{4}$", "[^\"]*")
FORMATS = ("date-time", "date", "time", "uuid", "email", "uri", "foo")
REFS = ("#", "#/properties/a", "#/properties/arguments", "#/$defs/x", "#/$defs/nope",
        "#/definitions/x", "http://example.com/s.json", "", "#/")
BOUNDS = (-1, 0, 1, 3, 999, 1000, 1001, 30_000, 2**31, 1.5, "3", None, 1e999)
NAMES = ("get_weather", "search", "run", "f", "read_file")
ODD_NAMES = ('f"g', "", "a b", "🙂", "x" * 300, "<tool_call>", "\n", "root", "pg-tool-call",
             "name", "arguments", "f\\", "'")
PROPS = ("a", "b", "path", "query", "n")
ODD_PROPS = ('a"b', "", " ", "\\", "🙂", "x" * 300, "$ref", "properties", "pg-tool-call", "root",
             "a-b", "1")

prop_names = mostly(st.sampled_from(PROPS), st.sampled_from(ODD_PROPS), one_in=5)
bounds = st.sampled_from(BOUNDS)
leaf_schemas = st.one_of(
    st.fixed_dictionaries({"type": mostly(st.sampled_from(TYPES), st.sampled_from(ODD_TYPES), 6)},
                          optional={"description": plain, "minLength": bounds,
                                    "maxLength": bounds, "pattern": st.sampled_from(PATTERNS),
                                    "format": st.sampled_from(FORMATS), "minimum": scalars,
                                    "maximum": scalars, "default": json_values,
                                    "minItems": bounds, "maxItems": bounds}),
    st.builds(lambda v: {"enum": v}, st.lists(scalars, max_size=3)),
    st.builds(lambda v: {"const": v}, json_values),
    st.builds(lambda r: {"$ref": r}, st.sampled_from(REFS)),
    st.sampled_from(({}, True, False, {"type": "string", "$schema": "x"})),
)


def _compound(s: Strategy) -> Strategy:
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(prop_names, s, max_size=3)},
            optional={"required": st.lists(prop_names, max_size=3) | hostile,
                      "additionalProperties": st.booleans() | s,
                      "$defs": st.fixed_dictionaries({"x": s, "y": s})}),
        st.fixed_dictionaries({"type": st.just("array"), "items": s | st.lists(s, max_size=2)},
                              optional={"minItems": bounds, "maxItems": bounds,
                                        "prefixItems": st.lists(s, max_size=2),
                                        "uniqueItems": st.booleans()}),
        st.builds(lambda k, v: {k: v}, st.sampled_from(("anyOf", "oneOf", "allOf")),
                  st.lists(s, max_size=3)),
        st.builds(lambda v: {"not": v}, s),
    )


# JSON schemas as agents write them and as they should not: $ref cycles, empty enums, bad
# patterns, huge bounds, unknown types (a forced call makes a grammar of them)
schemas = st.recursive(leaf_schemas, _compound, max_leaves=5)
object_schemas = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(prop_names, schemas, max_size=3)},
    optional={"required": st.lists(prop_names, max_size=2)})
arguments = st.dictionaries(prop_names, json_values, max_size=3).map(json.dumps)
ODD_ARGUMENTS = ("{", "[" * 1000, "[" * 3000 + "]" * 3000, "NaN", '{"a": 1e999}', '"\\ud800"',
                 "9" * 5000, '{"a": NaN}', "")
ROLES = ("user", "user", "user", "system", "developer", "assistant", "tool")
ANTHROPIC_ROLES = ("user", "user", "assistant", "system")
ODD_ROLES = ("function", "model", "System", "", "human", "ipython", None, 1, ["user"])
PART_TYPES = ("image_url", "input_audio", "file", "image", "refusal", "input_text", "", "TEXT")
BLOCK_TYPES = ("text", "text", "text", "tool_use", "tool_result", "thinking",
               "redacted_thinking")
ODD_BLOCK_TYPES = ("image", "document", "file", "container_upload", "server_tool_use",
                   "web_search_tool_result", "search_result", "tool_reference", "", "TEXT", 3,
                   None)


@dataclass(frozen=True, slots=True)
class Vocab:
    """What bodies are built from. CLEAN holds valid values only (which the APIs may still
    refuse in combination: a forced call on a schema with no grammar, a tool_use in a user
    turn, a prompt longer than the context); HOSTILE is the same with a hostile value in place
    one time in a few."""

    text: Strategy  # message text, descriptions, system
    max_tokens: Strategy
    stream: Strategy
    stops: Strategy
    prefix_cache: Strategy
    model: Strategy
    sampling: dict[str, Strategy]
    tool_name: Strategy
    parameters: Strategy  # a tool's schema
    role: Strategy  # OpenAI's
    anthropic_role: Strategy
    part_type: Strategy  # OpenAI content parts
    block_type: Strategy  # Anthropic content blocks
    arguments: Strategy  # OpenAI tool call arguments (JSON text)
    odd: Callable[[Strategy, Strategy, int], Strategy]  # (valid, bad, one_in): bad never in CLEAN
    value: Callable[[Strategy], Strategy]  # any other field: the valid strategy, or hostile


def vocab(odd: bool) -> Vocab:
    def pick(valid: Strategy, bad: Strategy, one_in: int = 8) -> Strategy:
        return mostly(valid, bad, one_in) if odd else valid

    return Vocab(
        text=mostly(plain, odd_text if odd else near_context, 12 if odd else 40),
        max_tokens=pick(st.integers(1, MAX_TOKENS), st.sampled_from(ODD_MAX_TOKENS)),
        stream=pick(st.sampled_from((True, False)), st.sampled_from(ODD_STREAM)),
        stops=pick(stops, odd_stops),
        prefix_cache=pick(prefix_cache, odd_prefix_cache),
        model=pick(st.sampled_from(MODELS), hostile),
        sampling={k: pick(valid, bad) for k, (valid, bad) in SAMPLING.items()},
        tool_name=pick(st.sampled_from(NAMES), st.sampled_from(ODD_NAMES) | odd_text),
        parameters=pick(object_schemas, st.one_of(schemas, hostile), 3),
        role=pick(st.sampled_from(ROLES), st.sampled_from(ODD_ROLES)),
        anthropic_role=pick(st.sampled_from(ANTHROPIC_ROLES), st.sampled_from(ODD_ROLES)),
        part_type=pick(st.just("text"), st.sampled_from(PART_TYPES) | hostile),
        block_type=pick(st.sampled_from(BLOCK_TYPES), st.sampled_from(ODD_BLOCK_TYPES)),
        arguments=pick(arguments, st.sampled_from(ODD_ARGUMENTS) | json_values),
        odd=pick,
        value=lambda valid: pick(valid, hostile, 10),
    )


CLEAN, HOSTILE = vocab(False), vocab(True)


# --- strategies: bodies ----------------------------------------------------------------------


@st.composite
def openai_tools(draw: st.DrawFn, v: Vocab) -> list[Any]:
    tools = []
    for _ in range(draw(st.sampled_from((0, 1, 1, 2, 3)))):
        fn = draw(st.fixed_dictionaries({"name": v.tool_name},
                                        optional={"description": v.text,
                                                  "parameters": v.parameters,
                                                  "strict": st.booleans()}))
        tools.append(draw(v.value(st.just({"type": "function", "function": fn}))))
    return tools


@st.composite
def anthropic_tools(draw: st.DrawFn, v: Vocab) -> list[Any]:
    server = st.fixed_dictionaries({"name": v.tool_name, "type": st.sampled_from(
        ("bash_20250124", "web_search_20250305"))})
    custom = st.fixed_dictionaries(
        {"name": v.tool_name, "input_schema": v.parameters},
        optional={"description": v.text, "type": st.just("custom"),
                  "cache_control": st.just({"type": "ephemeral"})})
    n = draw(st.sampled_from((0, 1, 1, 2, 3)))
    return [draw(v.value(mostly(custom, server, 10))) for _ in range(n)]


def tools_over_bounds(openai: bool) -> Strategy:
    """A `tools` list just over a bound of proxy/limits.py (tools, one tool's bytes, a schema's
    depth), as Raw JSON: nothing walks its items again."""
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(LIMITS.max_schema_depth):
        deep = {"type": "array", "items": deep}

    def tool(schema: dict[str, Any], description: str = "") -> dict[str, Any]:
        if openai:
            return {"type": "function", "function": {"name": "f", "description": description,
                                                     "parameters": schema}}
        return {"name": "f", "description": description, "input_schema": schema}

    return st.sampled_from((
        [tool({"type": "object"})] * (LIMITS.max_tools + 1),
        [tool({"type": "object"}, "x" * LIMITS.max_tool_bytes)],
        [tool(deep)])).map(lambda tools: Raw(json.dumps(tools)))


# `messages` one over max_messages
messages_over_bounds = st.just(Raw(json.dumps([{"role": "user", "content": "hi"}] *
                                              (LIMITS.max_messages + 1))))


def names_of(tools: Any) -> list[str]:
    out = []
    for t in tools if isinstance(tools, list) else []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.append(fn["name"])
    return out or ["nope"]


def openai_choice(v: Vocab, tools: list[Any]) -> Strategy:
    """auto / none, or a forced call: required or one tool by name."""
    named = st.sampled_from(names_of(tools)).map(
        lambda n: {"type": "function", "function": {"name": n}})
    odd = st.sampled_from(("any", {"type": "function"}, {"function": "x"}, {"name": "f"},
                           {"type": "function", "function": {"name": "nope"}}))
    return v.value(mostly(st.one_of(st.sampled_from(("auto", "none", "required")), named,
                                    named), odd, 6))


def anthropic_choice(v: Vocab, tools: list[Any]) -> Strategy:
    named = st.sampled_from(names_of(tools)).map(lambda n: {"type": "tool", "name": n})
    odd = st.sampled_from(({"type": "tool"}, {"type": "tool", "name": 5}, "auto",
                           {"type": "tool", "name": "nope"},
                           {"type": "function", "function": {"name": "f"}}))
    valid = st.one_of(st.sampled_from(({"type": "auto"}, {"type": "any"}, {"type": "none"},
                                       {"type": "any", "disable_parallel_tool_use": True})),
                      named, named)
    return v.value(mostly(valid, odd, 6))


@st.composite
def openai_message(draw: st.DrawFn, v: Vocab) -> dict[str, Any]:
    role = draw(v.role)
    part = st.fixed_dictionaries({"type": v.part_type, "text": v.text})
    msg = {"role": role, "content": draw(v.value(st.one_of(v.text, v.text, st.none(),
                                                           st.lists(part, max_size=3))))}
    if role == "assistant" and draw(chance(2)):
        call = st.fixed_dictionaries({"id": plain, "type": st.just("function"),
                                      "function": st.fixed_dictionaries(
                                          {"name": v.tool_name, "arguments": v.arguments})})
        msg["tool_calls"] = draw(v.value(st.lists(call, min_size=1, max_size=2)))
    if role == "tool":
        msg["tool_call_id"] = draw(v.value(plain))
    if draw(chance(8)):
        msg["name"] = draw(v.text)
    return msg


@st.composite
def anthropic_block(draw: st.DrawFn, v: Vocab) -> dict[str, Any]:
    kind = draw(v.block_type)
    text_blocks = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": v.text}),
                           max_size=2)
    fields = {
        "tool_use": {"id": plain, "name": v.tool_name,
                     "input": v.value(st.dictionaries(prop_names, json_values, max_size=3))},
        "tool_result": {"tool_use_id": plain, "content": v.value(v.text | text_blocks)},
        "thinking": {"thinking": v.text, "signature": plain},
        "redacted_thinking": {"data": plain},
    }.get(kind, {"text": v.text})
    optional = {"cache_control": st.just({"type": "ephemeral"}), "is_error": st.booleans()}
    return {"type": kind, **draw(st.fixed_dictionaries(fields, optional=optional))}


def anthropic_message(v: Vocab) -> Strategy:
    return st.fixed_dictionaries({"role": v.anthropic_role, "content": v.value(
        st.one_of(v.text, v.text, st.lists(anthropic_block(v), max_size=3)))})


@st.composite
def maybe(draw: st.DrawFn, fields: dict[str, Strategy], one_in: int = 4) -> dict[str, Any]:
    """Each field about one time in `one_in`."""
    return {k: draw(s) for k, s in fields.items() if draw(chance(one_in))}


@st.composite
def chat_body(draw: st.DrawFn, v: Vocab) -> dict[str, Any]:
    body = {"messages": draw(v.odd(st.lists(openai_message(v), min_size=1, max_size=3),
                                   messages_over_bounds, 40)),
            "max_tokens": draw(v.max_tokens)}
    if draw(chance(2)):
        body["tools"] = draw(v.odd(openai_tools(v), tools_over_bounds(openai=True), 30))
        if draw(chance(2)):
            body["tool_choice"] = draw(openai_choice(v, body["tools"]))
    if draw(chance(2)):
        body["stream"] = draw(v.stream)
    body |= draw(maybe({
        "model": v.model, "stop": v.stops, "prefix_cache": v.prefix_cache,
        "max_completion_tokens": v.max_tokens,
        "stream_options": v.value(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "parallel_tool_calls": st.booleans(), "n": v.value(st.just(1)),
        "response_format": st.just({"type": "json_object"}), "user": plain}))
    return body | draw(maybe(v.sampling, one_in=6))


@st.composite
def completion_body(draw: st.DrawFn, v: Vocab) -> dict[str, Any]:
    prompt = v.value(st.one_of(v.text, v.text, st.lists(v.text, min_size=1, max_size=1)))
    body = {"prompt": draw(prompt), "max_tokens": draw(v.max_tokens)}
    if draw(chance(2)):
        body["stream"] = draw(v.stream)
    body |= draw(maybe({"model": v.model, "stop": v.stops,
                        "prefix_cache": v.prefix_cache, "echo": st.booleans(),
                        "logprobs": st.one_of(st.none(), st.integers(0, 5)),
                        "stream_options": st.fixed_dictionaries(
                            {"include_usage": st.booleans()})}))
    return body | draw(maybe(v.sampling, one_in=6))


@st.composite
def messages_body(draw: st.DrawFn, v: Vocab, count_only: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(v.model), "messages": draw(v.odd(
        st.lists(anthropic_message(v), min_size=1, max_size=3), messages_over_bounds, 40))}
    if not count_only:
        body["max_tokens"] = draw(v.max_tokens)
        if draw(chance(2)):
            body["stream"] = draw(v.stream)
    if draw(chance(2)):
        body["tools"] = draw(v.odd(anthropic_tools(v), tools_over_bounds(openai=False), 30))
        if draw(chance(2)):
            body["tool_choice"] = draw(anthropic_choice(v, body["tools"]))
    system = st.one_of(v.text, st.lists(anthropic_block(v), min_size=1, max_size=2))
    body |= draw(maybe({"system": v.value(system), "stop_sequences": v.stops,
                        "prefix_cache": v.prefix_cache,
                        "metadata": v.value(st.just({"user_id": "u"})),
                        "thinking": v.value(st.just({"type": "enabled", "budget_tokens": 64}))}))
    return body | draw(maybe({k: v.sampling[k] for k in ("temperature", "top_p", "top_k")},
                             one_in=6))


BODIES: dict[str, Callable[[Vocab], Strategy]] = {
    "chat": chat_body, "completions": completion_body, "messages": messages_body,
    "count_tokens": lambda v: messages_body(v, count_only=True)}


# --- strategies: mutations, bytes, headers, cases --------------------------------------------

ADD_KEYS = ("stream", "tools", "tool_choice", "max_tokens", "messages", "role", "type",
            "content", "name", "input_schema", "parameters", "function", "text", "prompt",
            "system", "stop", "cache_control", "$ref", "prefix_cache", "")


def paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every node's path, the root's () first."""
    yield at
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from paths(v, (*at, k))


@st.composite
def mutated(draw: st.DrawFn, body: Any, n: int) -> tuple[Any, list[str]]:
    """`body` after `n` mutations anywhere in it: a node replaced by a hostile value, dropped,
    or given a hostile field or item."""
    kinds = []
    for _ in range(n):
        path = draw(st.sampled_from(list(paths(body))))
        op = draw(st.sampled_from(("set", "set", "drop", "add")))
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        node = parent[path[-1]] if path else body
        if op == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(ADD_KEYS) | plain)] = draw(hostile)
        elif op == "add" and isinstance(node, list):
            node.insert(draw(st.integers(0, len(node))), draw(hostile))
        elif op == "drop" and path:
            del parent[path[-1]]
        elif path:
            op = "set"
            parent[path[-1]] = draw(mostly(hostile, huge, 30))
        else:
            op = "set"
            body = draw(hostile)
        kinds.append(f"{op} {'.'.join(map(str, path))[:40] or 'body'}")
    return body, kinds


def cheap(endpoint: str, body: Any) -> Any:
    """A valid generation length above MAX_TOKENS, or none on the OpenAI APIs (up to the
    context's end), becomes MAX_TOKENS; invalid ones stay."""
    if not isinstance(body, dict) or endpoint == "count_tokens":
        return body
    keys = ("max_tokens",) if endpoint == "messages" else ("max_completion_tokens", "max_tokens")
    for k in keys:
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, int) and not isinstance(v, bool) and MAX_TOKENS < v <= 2**31:
            body[k] = MAX_TOKENS
        return body
    if endpoint != "messages":
        body["max_tokens"] = MAX_TOKENS
    return body


def encode(body: Any, ascii_only: bool) -> bytes:
    """The body as JSON bytes, Raw splices put in; a lone surrogate without ascii_only is
    written as its (invalid) UTF-8 bytes."""
    spliced: list[str] = []

    def splice(o: Any) -> str:
        assert isinstance(o, Raw), type(o)
        spliced.append(o.text)
        return f"\x00raw{len(spliced) - 1}\x00"

    text = json.dumps(body, ensure_ascii=ascii_only, default=splice)
    for i, t in enumerate(spliced):
        text = text.replace(f'"\\u0000raw{i}\\u0000"', t, 1)
    return text.encode("utf-8", "surrogatepass")


BAD_UTF8 = (b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xc0\x80", b"\xe0\x80\xaf",
            b"\xf4\x90\x80\x80", b"\x80", b"\xfe\xff")
SCALARS = (b"", b" ", b"\n", b"null", b"[]", b"[{}]", b'"x"', b"1", b"true", b"{}", b"{", b"}")


@st.composite
def mangled(draw: st.DrawFn, body: bytes) -> tuple[bytes, str]:
    """Bytes that are not a JSON body, most of them close to `body`."""
    how = draw(st.sampled_from(("truncated", "random", "bad utf-8", "bom", "scalar",
                                "trailing", "latin-1")))
    if how == "truncated":
        return body[:draw(st.integers(0, max(len(body) - 1, 0)))], how
    if how == "random":
        return draw(st.binary(max_size=64)), how
    if how == "bad utf-8":
        at = draw(st.integers(0, len(body)))
        return body[:at] + draw(st.sampled_from(BAD_UTF8)) + body[at:], how
    if how == "bom":
        return b"\xef\xbb\xbf" + body, how
    if how == "scalar":
        return draw(st.sampled_from(SCALARS)), how
    if how == "trailing":
        return body + draw(st.sampled_from((b" x", body, b"\x00", b"]"))), how
    return body.decode("utf-8", "replace").encode("latin-1", "replace"), how


ODD_KEYS = (b"", b"\xff\xfe", b"sk-\xed\xa0\x80", "ключ".encode(), b"k" * 8_000,
            b"k" * 9_000, b"a\x00b", b"\x7f", b" padded ", b"a\tb", b"\x1b[31m")
ENCODINGS = ("gzip", "gzip", "deflate", "deflate", "br", "zstd", "identity", "x-foo",
             "gzip, identity", "GZIP", "bomb")
CONTENT_TYPES = (None, "text/plain", "application/json; charset=latin-1",
                 "multipart/form-data; boundary=x", "application/x-www-form-urlencoded")


@functools.cache
def gzip_bomb() -> bytes:
    """Over max_body_bytes once unpacked; a few hundred KB sent."""
    return gzip.compress(b'{"prompt": "' + b" " * (LIMITS.max_body_bytes + 1) + b'"}',
                         compresslevel=1)


@st.composite
def odd_headers(draw: st.DrawFn, body: bytes, key: bytes
                ) -> tuple[bytes, list[tuple[str, bytes]], str]:
    """(body, headers, kind) with one odd header: the key, Authorization, Content-Encoding
    (the body encoded to match, or not) or Content-Type."""
    headers = [("Content-Type", b"application/json")]
    odd = draw(st.sampled_from(("key", "auth", "encoding", "content-type")))
    if odd == "key":
        headers.append(("x-api-key", draw(st.sampled_from(ODD_KEYS))))
    elif odd == "auth":
        auth = draw(st.sampled_from((b"Bearer " + key, b"bearer   " + key, b"Bearer",
                                     b"Basic YTpi", b"Bearer \xff\xfe", b"Bearer " + b"k" * 300)))
        headers.append(("Authorization", auth))
        if draw(chance(2)):
            headers.append(("x-api-key", key))
    elif odd == "encoding":
        enc = draw(st.sampled_from(ENCODINGS))
        packed = draw(st.booleans())
        if enc == "bomb":
            body, enc, packed = gzip_bomb(), "gzip", True
        elif packed and enc.lower().startswith("gzip"):
            body = gzip.compress(body)
        elif packed and enc == "deflate":
            body = zlib.compress(body)
        elif packed and enc == "br":
            body = brotli.compress(body)
        elif packed and enc == "zstd":
            body = zstd.compress(body)
        headers += [("x-api-key", key), ("Content-Encoding", enc.encode())]
        odd = f"encoding {enc}{' (packed)' if packed else ''}"
    else:
        ctype = draw(st.sampled_from(CONTENT_TYPES))
        headers = [("x-api-key", key)] + ([("Content-Type", ctype.encode())] if ctype else [])
    return body, headers, odd


# what is done to a generated body (one_of picks uniformly): mostly nothing or its fields
HOW = ("clean", "clean", "hostile fields", "hostile fields", "hostile fields", "mutated",
       "mutated", "mutated", "mangled", "headers")


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """One request to one of the four endpoints (see the module docstring)."""
    endpoint = draw(st.sampled_from(tuple(ENDPOINTS)))
    how = draw(st.sampled_from(HOW))
    v = HOSTILE if how == "hostile fields" else CLEAN
    body = copy.deepcopy(draw(BODIES[endpoint](v)))
    kinds = [how] if how in ("hostile fields", "headers") else []
    if how == "mutated":
        body, kinds = draw(mutated(body, draw(st.sampled_from((1, 1, 1, 2, 3)))))
    body = cheap(endpoint, body)
    wants = isinstance(body, dict) and body.get("stream") is True and endpoint != "count_tokens"
    data = encode(body, ascii_only=draw(st.booleans()))
    key = draw(st.sampled_from(KEYS)).encode()
    headers = [("Content-Type", b"application/json"), ("x-api-key", key)]
    if how == "mangled":
        data, what = draw(mangled(data))
        kinds, wants = [what], None
    elif how == "headers":
        data, headers, what = draw(odd_headers(data, key))
        kinds = [what]
    path = ENDPOINTS[endpoint][0]
    if endpoint in ALIASES and draw(chance(10)):
        path = ALIASES[endpoint]
    return Case(endpoint, path, data, tuple(headers), wants, draw(chance(20)), tuple(kinds))


# --- sending and checking --------------------------------------------------------------------


def send(port: int, case: Case, timeout_s: float = 120) -> Outcome:
    """One request on a fresh connection; an answer that came before the body was all sent (a
    refusal, then the server closed) is still read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        conn.putrequest("POST", case.path, skip_accept_encoding=True)
        for k, v in case.headers:
            conn.putheader(k, v)
        try:
            if case.chunked:
                conn.putheader("Transfer-Encoding", "chunked")
                step = max(1, len(case.body) // 3)
                pieces = [case.body[i:i + step] for i in range(0, len(case.body), step)]
                conn.endheaders(pieces, encode_chunked=True)
            else:
                conn.putheader("Content-Length", str(len(case.body)))
                conn.endheaders(case.body)
        except OSError:  # closed by the server while sending: its answer may be there
            pass
        r = conn.getresponse()
        data = r.read()
        return Outcome(r.status, r.getheader("Content-Type") or "", data,
                       time.perf_counter() - t0)
    except (OSError, http.client.HTTPException) as e:
        return Outcome(0, "", b"", time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def parser_refusal(out: Outcome) -> str | None:
    """The refusal's kind when aiohttp's HTTP parser answered, not a handler."""
    if out.status == 400 and out.content_type.startswith("text/plain"):
        text = out.data.decode("utf-8", "replace")
        return next((r for r in PARSER_REFUSALS if text.startswith(r)), None)
    return None


def error_problems(shape: str, out: Outcome) -> list[str]:
    if not out.content_type.startswith("application/json"):
        return ["non-JSON error body"]
    try:
        body = json.loads(out.data)
    except ValueError:
        return ["non-JSON error body"]
    err = body.get("error") if isinstance(body, dict) else None
    if shape == "openai":
        ok = set(body) == {"error"} and isinstance(err, dict) and \
            isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
    else:
        ok = body.get("type") == "error" and isinstance(err, dict) and \
            set(err) == {"type", "message"} and all(isinstance(v, str) for v in err.values())
    return [] if ok else [f"error not in the {shape} shape"]


def sse_events(data: bytes) -> list[tuple[str, str]]:
    """(event, data) of each event of a text/event-stream body."""
    events = []
    for block in data.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        event, lines = "message", []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                lines.append(line[6:])
            else:
                raise ValueError(f"not an SSE line: {line[:80]!r}")
        events.append((event, "\n".join(lines)))
    return events


def stream_problems(shape: str, data: bytes) -> list[str]:
    try:
        events = sse_events(data)
        if not events:
            return ["stream not ended (no events)"]
        if shape == "openai":
            *chunks, (_, last) = events
            parsed = [json.loads(d) for _, d in chunks]
            if last != "[DONE]" and "error" not in json.loads(last):
                return ["stream not ended ([DONE] or an error)"]
            if not all(isinstance(c, dict) and ("choices" in c or "error" in c)
                       for c in parsed):
                return ["stream chunk not a chunk"]
            return []
        parsed = [(e, json.loads(d)) for e, d in events]
    except (ValueError, TypeError) as e:
        return [f"stream not SSE of JSON objects ({type(e).__name__})"]
    if parsed[0][0] != "message_start" or parsed[-1][0] not in ("message_stop", "error"):
        return ["stream not ended (message_stop or event: error)"]
    if any(not isinstance(d, dict) or d.get("type") != e for e, d in parsed):
        return ["stream event type differs from its data"]
    return []


def answer_problems(endpoint: str, data: bytes) -> list[str]:
    try:
        body = json.loads(data)
        if endpoint == "count_tokens":
            ok = set(body) == {"input_tokens"} and body["input_tokens"] >= 1
        elif endpoint == "messages":
            ok = body["type"] == "message" and isinstance(body["content"], list) and \
                body["usage"]["output_tokens"] <= MAX_TOKENS
        else:
            kind = "chat.completion" if endpoint == "chat" else "text_completion"
            ok = body["object"] == kind and len(body["choices"]) == 1 and \
                body["usage"]["completion_tokens"] <= MAX_TOKENS
    except (ValueError, KeyError, TypeError, IndexError):
        ok = False
    return [] if ok else ["answer not of its kind"]


def problems(case: Case, out: Outcome) -> list[str]:
    """What is wrong with this answer to this request (the module docstring's checks)."""
    shape = ENDPOINTS[case.endpoint][1]
    if out.error:
        return ["no complete answer"]
    if out.status >= 500:
        return [f"status {out.status}"]
    if out.status != 200:
        return [] if parser_refusal(out) else error_problems(shape, out)
    streamed = out.content_type.startswith("text/event-stream")
    if case.stream is not None and streamed != case.stream:
        return ["stream asked for and answer differ"]
    return stream_problems(shape, out.data) if streamed else \
        answer_problems(case.endpoint, out.data)


# --- the campaign ----------------------------------------------------------------------------


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)  # endpoint -> requests
    asked_stream: Counter[str] = field(default_factory=Counter)
    answers: Counter[tuple[str, str]] = field(default_factory=Counter)  # (endpoint, kind)
    statuses: Counter[int] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)  # aiohttp parser refusals
    problems: Counter[str] = field(default_factory=Counter)
    examples: list[tuple[Case, Outcome, list[str]]] = field(default_factory=list)
    slowest: list[tuple[float, Case, int]] = field(default_factory=list)  # (s, case, status)
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, case: Case, out: Outcome, found: list[str]) -> int:
        """Counts one answer; returns how many were counted so far."""
        with self.lock:
            self.sent[case.endpoint] += 1
            self.asked_stream[case.endpoint] += bool(case.stream)
            self.statuses[out.status] += 1
            if out.status == 200:
                sse = out.content_type.startswith("text/event-stream")
                self.answers[case.endpoint, "200 stream" if sse else "200 JSON"] += 1
            if refusal := parser_refusal(out):
                self.refusals[refusal] += 1
            for p in found:
                self.problems[p] += 1
            if found and sum(1 for _, _, f in self.examples if f == found) < 3:
                self.examples.append((case, out, found))
            self.slowest = sorted([*self.slowest, (out.seconds, case, out.status)],
                                  key=lambda s: -s[0])[:5]
            return self.total

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def generate(n: int, seed: int, sink: Callable[[Case], None]) -> int:
    """Hands `n` distinct generated cases to `sink` (hypothesis driven by hand: seeded, no
    database, generation only; it repeats itself, so repeats are skipped and another seed goes
    on where one ran out); returns how many it made."""
    seen: set[bytes] = set()
    for attempt in range(100):
        if len(seen) >= n:
            break

        @hypothesis_seed(seed * 1000 + attempt)
        @settings(max_examples=max(n - len(seen), 100), database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(cases())
        def collect(case: Case) -> None:
            digest = hashlib.sha256(repr((case.path, case.headers, case.chunked)).encode() +
                                    case.body).digest()
            if len(seen) < n and digest not in seen:
                seen.add(digest)
                sink(case)

        collect()
    return len(seen)


def campaign(port: int, n: int, seed: int, clients: int,
             progress: Callable[[Tally], None] | None = None) -> Tally:
    """`n` generated requests sent by `clients` threads, each answer checked."""
    tally = Tally()
    todo: queue.Queue[Case | None] = queue.Queue(maxsize=clients * 4)

    def client() -> None:
        while (case := todo.get()) is not None:
            out = send(port, case)
            try:
                found = problems(case, out)
            except Exception as e:  # a bug here: counted, and the client goes on
                found = [f"checker failed: {type(e).__name__}: {e}"]
            if tally.add(case, out, found) % 500 == 0 and progress:
                progress(tally)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    generate(n, seed, todo.put)
    for _ in threads:
        todo.put(None)
    for t in threads:
        t.join()
    tally.seconds = time.perf_counter() - t0
    return tally


@contextlib.contextmanager
def serving(tmp: Path, extra: tuple[str, ...] = ()) -> Iterator[Server]:
    """The server under test (SERVER_ARGS, then `extra`), its log under `tmp`, its disk cache
    in memory (/dev/shm) where there is one: a snapshot save fsyncs, and on a busy shared disk
    single saves took 16 s. The cache is removed afterwards."""
    shm = Path("/dev/shm")
    cache = Path(tempfile.mkdtemp(prefix="prefixgate-fuzz-", dir=shm)) if shm.is_dir() \
        else tmp / "cache"
    try:
        with running(tmp, *SERVER_ARGS, *extra, cache_dir=cache) as srv:
            yield srv
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def worker_problems(srv: Server) -> list[str]:
    """The worker is the one that started, and the log holds no bug."""
    log = srv.log()
    found = []
    if (ready := len(re.findall(r"worker 0 ready \(pid \d+", log))) != 1:
        found.append(f"'worker 0 ready' {ready} times (a worker restarted)")
    if (exited := log.count("exited with")):
        found.append(f"'exited with' {exited} times in the log")
    if (tracebacks := log.count("Traceback")):
        found.append(f"{tracebacks} tracebacks in the log")
    if (internal := log.count("internal error")):
        found.append(f"'internal error' {internal} times in the log")
    workers = srv.get_json("/health")["workers"]
    if not (len(workers) == 1 and workers[0]["ready"]):
        found.append(f"/health: {workers}")
    return found


# a normal request on each API: its greedy answer must not change over the run
REFERENCE = (
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}],
                              "max_tokens": 6, "temperature": 0}),
    ("/v1/messages", {"model": "m", "max_tokens": 6, "temperature": 0,
                      "messages": [{"role": "user", "content": "Name three fruits."}]}),
)


def reference(port: int) -> list[str]:
    """The greedy answers to REFERENCE."""
    out = []
    for path, body in REFERENCE:
        case = Case("", path, json.dumps(body).encode(),
                    (("Content-Type", b"application/json"), ("x-api-key", KEYS[0].encode())),
                    False)
        got = send(port, case)
        assert got.status == 200, got.describe()
        answer = json.loads(got.data)
        out.append(answer["choices"][0]["message"]["content"] if "choices" in answer
                   else answer["content"][0]["text"])
    return out


# --- the report ------------------------------------------------------------------------------


def report(tally: Tally, crashes: list[str], before: list[str], after: list[str]) -> bool:
    """Prints the counts; True when nothing failed."""
    print(f"\n{'endpoint':<14}{'sent':>7}{'stream?':>9}{'200 JSON':>10}{'200 SSE':>9}")
    for e in ENDPOINTS:
        print(f"{e:<14}{tally.sent[e]:>7}{tally.asked_stream[e]:>9}"
              f"{tally.answers[e, '200 JSON']:>10}{tally.answers[e, '200 stream']:>9}")
    print(f"{'all':<14}{tally.total:>7}{sum(tally.asked_stream.values()):>9}")
    print("statuses:", ", ".join(f"{s or 'none'}: {n}" for s, n in sorted(tally.statuses.items())))
    n_5xx = sum(n for s, n in tally.statuses.items() if s >= 500)
    print(f"5xx: {n_5xx}")
    print(f"non-JSON error bodies: {tally.problems['non-JSON error body']}")
    others = {p: n for p, n in tally.problems.items()
              if p != "non-JSON error body" and not p.startswith("status ")}
    print("other failed checks:", ", ".join(f"{p}: {n}" for p, n in others.items()) or "none")
    print("aiohttp parser refusals (text/plain 400 before any handler, not failures):",
          ", ".join(f"{r}: {n}" for r, n in tally.refusals.items()) or "none")
    print("worker crashes / bugs in the log:", "; ".join(crashes) or "none (worker 0 ready "
          "once, no 'exited with', /health ready)")
    same = before == after
    print(f"normal requests after the run: {'unchanged' if same else 'CHANGED'} "
          f"(before {before!r}, after {after!r})")
    rate = tally.total / tally.seconds if tally.seconds else 0.0
    print(f"wall time: {tally.seconds:.0f} s ({rate:.1f} requests/s); slowest: " + ", ".join(
        f"{s:.1f} s ({c.endpoint} {status}, {len(c.body)} bytes)"
        for s, c, status in tally.slowest))
    for case, out, found in tally.examples:
        print(f"\nFAILED {', '.join(found)}\n  {case.describe()}\n  -> {out.describe()}")
    return not (tally.problems or crashes or not same)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000, help="requests to send")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    p.add_argument("--clients", type=int, default=8,
                   help="concurrent clients (more than one: refusals go on while the one "
                        "worker generates)")
    p.add_argument("--server-args", default="",
                   help="more options for the server under test, e.g. \"-np 2 -md MODEL\" "
                        "(MODEL: the default model's file)")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="prefixgate-fuzz-"))
    extra = tuple(a.replace("MODEL", default_model()) for a in shlex.split(args.server_args))
    print(f"prefixgate fuzz: {args.requests} requests, seed {args.seed}, {args.clients} "
          f"clients{', server ' + ' '.join(extra) if extra else ''}; server log under {tmp}",
          flush=True)
    with serving(tmp, extra) as srv:
        before = reference(srv.port)

        def progress(t: Tally) -> None:
            print(f"  {t.total} sent, statuses {dict(sorted(t.statuses.items()))}", flush=True)

        tally = campaign(srv.port, args.requests, args.seed, args.clients, progress)
        crashes = worker_problems(srv)
        after = reference(srv.port)
    ok = report(tally, crashes, before, after)
    for i, (case, out, found) in enumerate(tally.examples):  # the exact bytes, to reproduce
        (tmp / f"failure-{i}.body").write_bytes(case.body)
        (tmp / f"failure-{i}.txt").write_text(f"{found}\n{case.describe(0)}\n{out.describe()}\n")
    print(f"\nserver log: {srv.log_path}" + (f"; failing requests: {tmp}/failure-*"
                                              if tally.examples else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
