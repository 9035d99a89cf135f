"""Tool calls: the parser and the prompt rendering as tables, then the official `openai` SDK
against a real prefixgate (forced calls go through llama.cpp grammar sampling)."""

from __future__ import annotations

import json

import openai
import pytest

from proxy.dialects import CallDone, TextDelta, for_template
from proxy.errors import BadRequest
from proxy.tools import hermes_messages, parse_choice
from tests.conftest import Server
from tests.models import reusable

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                   "required": ["tz"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}' \
       '\n</tool_call>'


# --- the parser, piece by piece ------------------------------------------------------------


HERMES = for_template("")  # the default dialect, and the tools section prefixgate writes


def call_grammar(tools: tuple, choice: object) -> str | None:
    return HERMES.forced(tools, choice, "")


def run_parser(pieces: list[str], tools: tuple = (WEATHER,)) -> list[str | tuple[str, dict]]:
    """The text between calls (joined) and the calls."""
    s = HERMES.stream(tools, "auto", "")
    out: list[str | tuple[str, dict]] = []
    for ev in [e for piece in pieces for e in s.feed(piece)] + s.finish():
        if isinstance(ev, TextDelta):
            if out and isinstance(out[-1], str):
                out[-1] += ev.text
            else:
                out.append(ev.text)
        elif isinstance(ev, CallDone):
            out.append((ev.call.name, ev.call.arguments))
    return out


def split_every(s: str, n: int) -> list[str]:
    return [s[i:i + n] for i in range(0, len(s), n)]


OSLO = ("get_weather", {"city": "Oslo", "unit": "celsius"})

PARSES = [
    # plain text passes through unchanged, whatever the piece boundaries
    (["Hello", " world", "\n"], ["Hello world\n"]),
    # a call alone, in pieces that split the tags anywhere
    (split_every(CALL, 3), [OSLO]),
    (split_every(CALL, 7), [OSLO]),
    # text before a call keeps its words; the whitespace next to the call goes
    (["Let me check.\n", CALL, "\n"], ["Let me check.", OSLO]),
    # two calls in a row
    ([CALL, "\n", CALL], [OSLO, OSLO]),
    # a call, then text
    ([CALL, "\n\nDone."], [OSLO, "Done."]),
    # "parameters" instead of "arguments", and arguments as a JSON string
    (['<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
      '</tool_call>'], [OSLO]),
    (['<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", '
      '\\"unit\\": \\"celsius\\"}"}</tool_call>'], [OSLO]),
    # not JSON, an undeclared tool, an unclosed call: all stay text
    (["<tool_call>{oops}</tool_call>"], ["<tool_call>{oops}</tool_call>"]),
    (['<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'],
     ['<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>']),
    (["<tool_call>\n{\"name\": \"get_wea"], ["<tool_call>\n{\"name\": \"get_wea"]),
    # a '<' that does not become the tag is released (trailing spaces wait for what follows)
    (["a <", "b> c"], ["a <b> c"]),
]


@pytest.mark.parametrize("pieces,expected", PARSES)
def test_parser(pieces: list[str], expected: list) -> None:
    assert run_parser(pieces) == expected


def test_text_without_calls_is_reproduced_exactly() -> None:
    text = "Use <b>bold</b> and x < y;\n\n  indented\n"
    for n in (1, 2, 5):
        assert "".join(run_parser(split_every(text, n))) == text  # type: ignore[arg-type]


# --- the prompt ----------------------------------------------------------------------------


def test_hermes_rendering_of_a_tool_conversation() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Rain, 8 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "Wind"},
        {"role": "user", "content": "Thanks."},
    ]
    out = hermes_messages(messages, (WEATHER,))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in system
    assert out[2]["content"] == CALL
    assert out[3]["content"] == ("<tool_response>\nRain, 8 C\n</tool_response>\n"
                                 "<tool_response>\nWind\n</tool_response>\nThanks.")
    # a conversation without a system message gets one holding only the tools
    assert hermes_messages(messages[1:2], (WEATHER,))[0]["content"].startswith("# Tools")


def test_schema_noise_stays_out_of_the_prompt() -> None:
    noisy = json.loads(json.dumps(WEATHER))
    noisy["function"]["parameters"]["$schema"] = "http://json-schema.org/draft-07/schema#"
    clean = hermes_messages([{"role": "user", "content": "x"}], (WEATHER,))
    assert hermes_messages([{"role": "user", "content": "x"}], (noisy,)) == clean


CHOICES = [
    # (raw tool_choice, tools, internal choice or the error fragment)
    (None, (), "auto"),
    ("none", (WEATHER,), "none"),
    ("required", (WEATHER,), "required"),
    ({"type": "function", "function": {"name": "get_weather"}}, (WEATHER,),
     {"name": "get_weather"}),
    ("required", (), "no 'tools'"),
    ({"type": "function", "function": {"name": "nope"}}, (WEATHER,), "'nope'"),
    ("always", (WEATHER,), "must be auto, none, required"),
]


@pytest.mark.parametrize("raw,tools,expected", CHOICES)
def test_parse_choice(raw: object, tools: tuple, expected: object) -> None:
    if isinstance(expected, str) and expected not in ("auto", "none", "required"):
        with pytest.raises(BadRequest, match=expected):
            parse_choice(raw, tools)
    else:
        assert parse_choice(raw, tools) == expected


def test_grammar_only_for_forced_choices() -> None:
    assert call_grammar((WEATHER,), "auto") is None
    assert call_grammar((WEATHER,), "none") is None
    named = call_grammar((WEATHER, TIME), {"name": "get_time"})
    assert named is not None and "get_time" in named and "get_weather" not in named
    both = call_grammar((WEATHER, TIME), "required")
    assert both is not None and "get_time" in both and "get_weather" in both
    # a schema the converter cannot take falls back to any JSON object
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "https://example.invalid/x.json"}}}}}
    assert call_grammar((odd,), "required") is not None


# --- the OpenAI SDK against the real model --------------------------------------------------


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="test-key", max_retries=0, timeout=600)


def check_weather(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
    assert args["unit"] in ("celsius", "fahrenheit")
    return dict(args)


def test_streaming_tool_call_deltas_reassemble(server: Server) -> None:
    stream = client(server).chat.completions.create(
        model="m", temperature=0, max_tokens=64, stream=True, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What's the weather in Lisbon?"}])
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in stream:
        choice = chunk.choices[0]
        finishes.append(choice.finish_reason)
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finishes[-1] == "tool_calls" and all(f is None for f in finishes[:-1])
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    check_weather(calls[0]["arguments"])


def test_tool_choice_required(server: Server) -> None:
    resp = client(server).chat.completions.create(
        model="m", temperature=0, max_tokens=64, tools=[WEATHER, TIME], tool_choice="required",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls  # type: ignore[misc]
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        assert isinstance(args["tz"], str)
    else:
        check_weather(call.function.arguments)


def test_tool_message_turn(server: Server) -> None:
    messages: list[dict] = [{"role": "user", "content": "What's the weather in Oslo?"}]
    first = client(server).chat.completions.create(
        model="m", temperature=0, max_tokens=64, tools=[WEATHER], tool_choice="required",
        messages=messages)  # type: ignore[arg-type]
    msg = first.choices[0].message
    (call,) = msg.tool_calls  # type: ignore[misc]
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Rain, 8 degrees."}]
    second = client(server).chat.completions.create(
        model="m", temperature=0, max_tokens=16, tools=[WEATHER], messages=messages)  # type: ignore
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    u2 = second.usage
    assert u2 is not None and u2.prompt_tokens > first.usage.prompt_tokens  # type: ignore
    # the first turn's prompt is reused: tool schemas and the question are not prefilled again
    assert u2.prompt_tokens_details.cached_tokens >= reusable(first.usage.prompt_tokens)  # type: ignore


def test_tool_choice_none_leaves_text_alone(server: Server) -> None:
    resp = client(server).chat.completions.create(
        model="m", temperature=0, max_tokens=8, tools=[WEATHER], tool_choice="none",
        messages=[{"role": "user", "content": "Say hello."}])
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.choices[0].message.tool_calls is None


def test_unknown_forced_tool_is_a_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(server).chat.completions.create(
            model="m", max_tokens=4, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "launch"}},
            messages=[{"role": "user", "content": "x"}])
    assert "'launch'" in exc.value.body["message"]  # type: ignore[index]
