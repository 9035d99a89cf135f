"""proxy/limits.py as tables: request bodies in, the parsed body or the 400 out, naming the field,
the value and the limit. Small limits keep the cases small. Then generated hostile bodies: load
either answers or raises BadRequest, never anything else. No server, no model."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest

from proxy.errors import BadRequest
from proxy.limits import LIMITS, Limits, check_request, load, parse

SMALL = Limits(max_body_bytes=10_000, max_depth=4, max_int_digits=5, max_string_chars=10,
               max_array_items=3, max_messages=2, max_stop_strings=2, max_stop_chars=4,
               max_tools=2, max_tool_bytes=200, max_schema_depth=3)

M = {"role": "user", "content": "hi"}


def tool(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


# raw body -> the parsed body (within SMALL)
ACCEPTED: dict[str, tuple[bytes, Any]] = {
    # depth 4 exactly: body, messages, message, content list
    "at the depth limit": (b'{"m": [{"c": ["x"]}]}', {"m": [{"c": ["x"]}]}),
    # 5 digits (the sign does not count); floats are not integers
    "integers at the limit": (b'[-99999, 1e400, 0.5]', [-99999, float("inf"), 0.5]),
    # a surrogate pair is one character; an escaped backslash before "ud800" is no escape
    "surrogate pair": (b'["\\ud83d\\ude00", "\\\\ud800"]', ["\U0001F600", "\\ud800"]),
    # 10 characters, not bytes
    "string at the limit": (('"' + "é" * 10 + '"').encode(), "é" * 10),
}


@pytest.mark.parametrize("raw, expected", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepted(raw: bytes, expected: Any) -> None:
    assert load(raw, SMALL) == expected


# raw body -> words the 400's message must hold (where, the value, the limit's name)
REJECTED: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "not UTF-8": (b'{"a": "\xff"}', ("not valid UTF-8", "byte 7")),
    "UTF-8 of a surrogate": (b'{"a": "\xed\xa0\x80"}', ("not valid UTF-8",)),
    "not JSON": (b'{"a": ', ("not valid JSON",)),
    "NaN": (b'{"t": NaN}', ("not valid JSON", "NaN")),
    "Infinity": (b'[-Infinity]', ("-Infinity",)),
    # deeper than the limit: where and how deep
    "one level too deep": (b'{"m": [{"c": [["x"]]}]}', ("m[0].c[0]", "5 levels", "max_depth")),
    # deeper than the interpreter parses: never a RecursionError
    "far too deep": (b"[" * 100_000 + b"]" * 100_000, ("far deeper", "max_depth")),
    "long integer": (b'{"seed": 123456}', ("6 digits", "max_int_digits")),
    # past Python's own 4,300-digit limit: never a ValueError
    "huge integer": (b"[" + b"9" * 5000 + b"]", ("5000 digits", "max_int_digits")),
    "lone high surrogate": (b'{"messages": [{"content": "a\\ud800"}]}',
                            ("messages[0].content", "'\\ud800'", "character 1")),
    "lone low surrogate, upper case": (b'{"x": ["\\uDC00"]}', ("x[0]", "lone surrogate")),
    # the message shows the key escaped: it goes to logs and JSON
    "surrogate in a key": (b'{"\\ud800": 1}', ("\\ud800 (the key)", "lone surrogate")),
    "long string": (b'{"system": "12345678901"}', ("system", "11 characters", "max_string_chars")),
    "long key": (b'{"12345678901": 0}', ("(the key)", "max_string_chars")),
    "long array": (b'{"stop": [1, 2, 3, 4]}', ("stop", "4 items", "max_array_items")),
}


@pytest.mark.parametrize("raw, words", REJECTED.values(), ids=REJECTED.keys())
def test_rejected(raw: bytes, words: tuple[str, ...]) -> None:
    with pytest.raises(BadRequest) as e:
        load(raw, SMALL)
    for w in words:
        assert w in e.value.message
    assert e.value.status == 400


# parsed body -> words of the 400 (None: accepted)
FIELDS: dict[str, tuple[Any, tuple[str, ...] | None]] = {
    "two messages": ({"messages": [M, M]}, None),
    "three messages": ({"messages": [M, M, M]}, ("3 messages", "max_messages")),
    # a string is one stop string
    "one stop string": ({"stop": "abcd"}, None),
    "three stop strings": ({"stop": ["a", "b", "c"]}, ("'stop'", "3 strings", "max_stop_strings")),
    "long stop string": ({"stop": "abcde"}, ("stop[0]", "5 characters", "max_stop_chars")),
    "long stop sequence": ({"stop_sequences": ["a", "abcde"]},
                           ("stop_sequences[1]", "max_stop_chars")),
    "three tools": ({"tools": [tool("a", {}), tool("b", {}), tool("c", {})]},
                    ("3 tools", "max_tools")),
    "big tool": ({"tools": [tool("big", {"description": "x" * 200})]},
                 ("tools[0] ('big')", "bytes of JSON", "max_tool_bytes")),
    # the schema object is level 1: object, properties, a property
    "schema at the depth limit": ({"tools": [tool("a", {"properties": {"x": {}}})]}, None),
    "deep OpenAI schema": ({"tools": [tool("a", {"properties": {"x": {"items": {}}}})]},
                           ("tools[0] ('a')", "parameters schema nests 4", "max_schema_depth")),
    "deep Anthropic schema": ({"tools": [{"name": "b", "input_schema": {"a": [[{}]]}}]},
                              ("tools[0] ('b')", "input_schema schema nests 4")),
    # the wrong types are left to the API parsers, which say what to send
    "wrong types": ({"messages": "x", "stop": 3, "tools": {"a": 1}}, None),
    "not an object": ([1, 2], None),
}


@pytest.mark.parametrize("body, words", FIELDS.values(), ids=FIELDS.keys())
def test_fields(body: Any, words: tuple[str, ...] | None) -> None:
    if words is None:
        check_request(body, SMALL)
        return
    with pytest.raises(BadRequest) as e:
        check_request(body, SMALL)
    for w in words:
        assert w in e.value.message


def test_json_inside_a_string_has_the_same_bounds() -> None:
    where = "messages[0].tool_calls[0].function.arguments"
    assert parse('{"a": [1]}', SMALL, where) == {"a": [1]}
    for text, word in (('{"a": "\\ud800"}', f"{where}.a has a lone surrogate"),
                       ("[" * 5000 + "]" * 5000, f"{where} nests far deeper"),
                       ("1234567", f"{where} has an integer of 7 digits")):
        with pytest.raises(BadRequest, match=word.replace("[", r"\[").replace("]", r"\]")):
            parse(text, SMALL, where)
    with pytest.raises(json.JSONDecodeError):  # not JSON: the caller decides
        parse("{", SMALL, where)


def test_defaults_take_what_real_agents_send() -> None:
    """A Claude Code-sized body: a 20K-token system prompt, 24 tools with big schemas, a few
    thousand messages, a tool schema 16 levels deep, a 64-bit seed."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5):
        schema = {"type": "object", "properties": {"x": {"type": "array", "items": schema}}}
    tools = [{"name": f"t{i}", "description": "d" * 4000,
              "input_schema": {**schema, "properties": {**schema["properties"], **{
                  f"p{j}": {"type": "string", "description": "p" * 200} for j in range(40)}}}}
             for i in range(24)]
    body = {"system": "s" * 80_000, "tools": tools, "seed": 2**64 - 1, "stop_sequences": ["\n\n"],
            "messages": [{"role": "user" if i % 2 == 0 else "assistant",
                          "content": [{"type": "text", "text": f"turn {i} " * 50}]}
                         for i in range(3000)]}
    raw = json.dumps(body).encode()
    assert len(raw) < LIMITS.max_body_bytes
    assert load(raw) == body
    check_request(body)


def hostile(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value leaning to what breaks parsers: depth, long integers, surrogates."""
    kind = rng.choice(("deep", "int", "str", "obj", "arr", "num", "lit"))
    if kind == "deep":
        return "[" * rng.choice((3, 60, 2000)) + "]" * rng.choice((0, 3, 60, 2000))
    if kind == "int":
        return "-" * rng.randint(0, 1) + "9" * rng.choice((1, 5, 6, 4301, 10_000))
    if kind == "str":
        return json.dumps(rng.choice(("", "x" * 11, "é")))[:-1] + rng.choice(
            ("", "\\ud800", "\\udfff\\ud800", "\\ud83d\\ude00", "\\u0000", "\\")) + '"'
    if kind == "num":
        return rng.choice(("1e999", "-0.0", "1.5e-400", "NaN", "Infinity", "01", "1."))
    if kind == "lit":
        return rng.choice(("true", "null", "tru", '"\xff"', "\ud800"))
    if depth > 3:
        return "0"
    items = [hostile(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "arr":
        return "[" + ",".join(items) + "]"
    keys = [rng.choice(("messages", "stop", "tools", "x", "\\ud800")) for _ in items]
    return "{" + ",".join(f'"{k}":{v}' for k, v in zip(keys, items, strict=True)) + "}"


def test_generated_hostile_bodies_are_parsed_or_refused() -> None:
    rng = random.Random(14)
    outcomes = {"parsed": 0, "refused": 0}
    for _ in range(3000):
        raw = hostile(rng).encode("utf-8", "surrogatepass")
        try:
            body = load(raw, SMALL)
            check_request(body, SMALL)
        except BadRequest as e:
            assert e.status == 400 and e.message
            outcomes["refused"] += 1
            continue
        json.dumps(body, ensure_ascii=False).encode()  # what was parsed can be encoded again
        outcomes["parsed"] += 1
    assert min(outcomes.values()) > 300, outcomes


def test_limits_are_configurable_by_name() -> None:
    from proxy.limits import LIMITS, with_overrides

    assert with_overrides(("max_messages=50000", "max_depth=10")) == \
        replace(LIMITS, max_messages=50000, max_depth=10)
    for bad in ("max_messages", "nope=3", "max_depth=-1", "max_depth=ten"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            with_overrides((bad,))


# --- a body that repeats a recent one (issue 23): reused values, the same answers -------------


def conversation_body(n: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    messages: list[Any] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(n):
        messages.append({"role": "user", "content": f"step {i} " + "x" * rng.randrange(40)})
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "read", "arguments": json.dumps({"n": i, "f": 1.0})}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"line {i}"})
    return {"model": "m", "messages": messages, "tools": [tool("read", {"type": "object"})],
            "max_tokens": 16}


def test_a_growing_conversation_reuses_what_it_repeats() -> None:
    """Each turn parses to what json.loads makes of it; the messages (and the tools after them)
    it repeats are the very objects parsed the turn before; an edit in the middle is parsed
    again from there."""
    before: Any = None
    for n in range(1, 8):
        body = conversation_body(n)
        if n >= 5:  # the client rewrote an early message at turn 5
            body["messages"][1] = {"role": "user", "content": "rewritten"}
        raw = json.dumps(body).encode()
        got = load(raw)
        assert got == json.loads(raw) and json.dumps(got) == json.dumps(json.loads(raw))
        if before is not None:
            shared = 1 if n == 5 else len(before["messages"])
            assert all(a is b for a, b in zip(got["messages"][:shared],
                                              before["messages"][:shared], strict=True))
            assert got["messages"][shared] is not before["messages"][shared] \
                if shared < len(before["messages"]) else True
            assert got["tools"] is before["tools"]  # the same text after the new messages
        before = got


def test_a_new_message_that_breaks_a_bound_is_refused_as_without_reuse() -> None:
    """The reused part met the bounds; a new message is checked, and refused with the words
    the plain parse uses (which the fallback gives)."""
    body = conversation_body(3)
    load(json.dumps(body).encode())
    deep: Any = "x"
    for _ in range(70):
        deep = [deep]
    body["messages"].append({"role": "user", "content": deep})
    raw = json.dumps(body).encode()
    with pytest.raises(BadRequest) as reused:
        load(raw)
    with pytest.raises(BadRequest) as plain:
        parse(raw.decode())
    assert str(reused.value) == str(plain.value) and "max_depth" in str(reused.value)
    for bad in (b'{"messages": [{"role": "user", "content": "hi"}], "x": NaN}',
                b'{"messages": [{"role": "user", "content": "hi"}], "x": 1' + b"0" * 30 + b"}"):
        with pytest.raises(BadRequest) as e:
            load(bad)
        assert "not valid JSON" in str(e.value) or "max_int_digits" in str(e.value)


def test_reuse_is_per_set_of_bounds() -> None:
    """A body parsed under other bounds is not reused: those bounds were not checked."""
    small = replace(LIMITS, max_array_items=4)
    body = conversation_body(1)
    load(json.dumps(body).encode())  # 4 messages: within both
    body["messages"].append(M)
    with pytest.raises(BadRequest, match="max_array_items"):
        load(json.dumps(body).encode(), small)


# --- issue 46: sessions that take turns, subagents and title calls ------------------------------


def replay(rows: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Each row through `load` and the Anthropic parser, as the edge does, with nothing
    remembered before; per session (`metadata.user_id`), how many of its requests resumed the
    Anthropic parse after some of their messages (the same objects as its last turn's)."""
    from proxy import anthropic_api, limits

    monkeypatch.setattr(limits, "_RECENT", limits._Recent())
    monkeypatch.setattr(anthropic_api, "_RECENT", anthropic_api._Recent())
    resumed: dict[str, int] = {}
    for row in rows:
        body = load(json.dumps(row).encode())
        _, start = anthropic_api._RECENT.find(
            anthropic_api._text_blocks(body.get("system"), "system")[0], body["messages"])
        anthropic_api.parse_request(body, "")
        who = row["metadata"]["user_id"]
        resumed[who] = resumed.get(who, 0) + (start > 0)
    return resumed


def test_sessions_that_take_turns_resume_as_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interleaved trace's shape (bench/traces/interleaved-gitstatus.jsonl): four sessions
    take turns; each resumes on every turn but its first and the one whose gitStatus line (in
    the system prompt) changed, exactly as when it runs alone."""
    from bench.interleaved import Knobs, generate

    rows = list(generate(Knobs(system_tokens=300, tail_tokens=20)))
    alone = sorted(rows, key=lambda r: r["metadata"]["user_id"])  # stable: turns in order
    expected = {"session-0": 4, "session-1": 4, "session-2": 5, "session-3": 5}
    assert replay(alone, monkeypatch) == expected
    assert replay(rows, monkeypatch) == expected


def test_title_calls_and_a_subagent_between_turns_do_not_stop_the_resume(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's turns with a title call (another system prompt, one message) and a
    subagent's turns (its own system prompt and history) between them: both resume."""
    from bench.interleaved import Knobs, generate

    main_rows = list(generate(Knobs(sessions=1, turns=6, changed=0, system_tokens=300,
                                    tail_tokens=20)))
    sub = list(generate(Knobs(sessions=1, turns=3, changed=0, system_tokens=200,
                              tail_tokens=20), seed=7))
    for r in sub:
        r["metadata"] = {"user_id": "subagent"}
    title = {"model": "synthetic", "system": "Write a 5-10 word title for the conversation.",
             "messages": [{"role": "user", "content": "Fix the bug in main.py"}],
             "max_tokens": 20, "metadata": {"user_id": "title"}}
    rows = [main_rows[0], title, main_rows[1], sub[0], main_rows[2], sub[1], main_rows[3],
            sub[2], main_rows[4], title, main_rows[5]]
    assert replay(rows, monkeypatch) == {"session-0": 5, "title": 0, "subagent": 2}


def test_a_retry_or_the_next_turn_replaces_the_body_it_repeats() -> None:
    """The bound holds by replacing: a conversation's turns keep one body, not one each."""
    from proxy.limits import _Recent

    recent = _Recent(max_bodies=4)
    for n in range(1, 7):
        assert recent.load(json.dumps(conversation_body(n)), LIMITS) is not None
    recent.load(json.dumps(conversation_body(6)), LIMITS)  # a retry
    assert len(recent._bodies) == 1
    for seed in range(1, 7):  # other conversations: the least recently used goes first
        recent.load(json.dumps(conversation_body(2, seed)), LIMITS)
    assert len(recent._bodies) == 4
