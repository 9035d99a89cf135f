"""The Anthropic Messages API end to end: the official `anthropic` SDK (and raw HTTP where the
SDK hides the wire: pings, headers) against a real prefixgate with real worker processes."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from tests.conftest import N_CTX, Server, running, start_server
from tests.models import reusable

pytestmark = pytest.mark.model  # real worker processes (see tests/conftest.py)

SYSTEM = (
    "You are a careful assistant for a small software team. Answer briefly and precisely. "
    "The project is a reverse proxy written in Python with aiohttp; it forwards requests to "
    "worker processes that run a language model, and it caches the model's key-value state on "
    "disk so that long, repeated prompt prefixes do not have to be computed again."
)
GREEDY = {"temperature": 0}  # the 2.x SDK has no temperature argument; the API still takes it

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#",  # Claude Code sends this
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


def client(srv: Server, key: str = "test-key") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=600)


def create(srv: Server, messages: list[dict], **kw: object) -> anthropic.types.Message:
    kw.setdefault("extra_body", GREEDY)
    return client(srv).messages.create(model=str(kw.pop("model", "claude-local")),
                                       max_tokens=int(kw.pop("max_tokens", 12)),  # type: ignore
                                       messages=messages, **kw)  # type: ignore[arg-type]


def count(srv: Server, messages: list[dict], **kw: object) -> int:
    return client(srv).messages.count_tokens(model="m", messages=messages,  # type: ignore
                                             **kw).input_tokens


def prompt_len(u: anthropic.types.Usage) -> int:
    return u.input_tokens + (u.cache_read_input_tokens or 0) + \
        (u.cache_creation_input_tokens or 0)


def post_raw(srv: Server, path: str, body: dict | bytes, headers: dict | None = None
             ) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# --- text ----------------------------------------------------------------------------------


def test_non_streaming_text(server: Server) -> None:
    msg = create(server, [{"role": "user", "content": "What is a mutex?"}], system=SYSTEM)
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.model == "SmolLM2-135M-Instruct.Q4_1"
    assert len(msg.content) == 1 and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens <= 12
    assert prompt_len(msg.usage) > 80


def test_streaming_text_matches_non_streaming(server: Server) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    with client(server).messages.stream(model="m", max_tokens=16, messages=messages,
                                        extra_body=GREEDY) as stream:
        types = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert types[-2] == "message_delta"
    assert types.count("content_block_start") == 1 == types.count("content_block_stop")
    full = create(server, messages, max_tokens=16)
    assert final.content[0].text == full.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens


def test_wire_event_sequence(server: Server) -> None:
    """The exact SSE frames, including the ping the SDK hides; ?beta=true and unknown fields
    and headers are accepted."""
    body = {"model": "m", "max_tokens": 8, "stream": True, "temperature": 0,
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Say hi.", "cache_control": {"type": "ephemeral"}}]}],
            "metadata": {"user_id": "u1"}, "thinking": {"type": "disabled"},
            "context_management": {"edits": []}, "output_config": {"effort": "low"}}
    status, headers, raw = post_raw(server, "/v1/messages?beta=true", body, {
        "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert status == 200, raw
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    names = [e for e, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta", "ping"}
    assert all(e == d["type"] for e, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] <= 8
    assert prompt_len(anthropic.types.Usage(**delta["usage"])) == \
        prompt_len(anthropic.types.Usage(**start["usage"]))


def test_system_blocks_equal_the_joined_string(server: Server) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    blocks = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
    assert count(server, messages, system=blocks) == \
        count(server, messages, system="First part.\n\nSecond part.")


# --- usage and the cache -------------------------------------------------------------------


def test_count_tokens_equals_the_next_prompt(server: Server) -> None:
    messages = [{"role": "user", "content": "Explain a hash map in one line."}]
    n = count(server, messages, system=SYSTEM, tools=[WEATHER])
    msg = create(server, messages, system=SYSTEM, tools=[WEATHER], max_tokens=4)
    assert prompt_len(msg.usage) == n
    assert count(server, messages, system=SYSTEM) < n  # the tools are in the prompt
    assert count(server, messages) < count(server, messages, system=SYSTEM)


def test_second_turn_reads_the_cache(server: Server) -> None:
    first = [{"role": "user", "content": "Explain what a reverse proxy does."}]
    m1 = create(server, first, system=SYSTEM, max_tokens=16)
    second = [*first, {"role": "assistant", "content": m1.content[0].text},  # type: ignore
              {"role": "user", "content": "And why cache state on disk?"}]
    n2 = count(server, second, system=SYSTEM)
    m2 = create(server, second, system=SYSTEM, max_tokens=8)
    u = m2.usage
    assert u.cache_read_input_tokens is not None and u.cache_read_input_tokens > 0
    assert u.cache_read_input_tokens >= reusable(prompt_len(m1.usage))
    assert u.input_tokens >= 0 and (u.cache_creation_input_tokens or 0) >= 0
    assert prompt_len(u) == n2


def test_billing_header_is_stripped(server: Server) -> None:
    """Claude Code's first system block changes `cch=` on every request; without stripping it
    two sessions would share a couple of dozen tokens."""
    def system(cch: str) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.0.abc; "
                                         f"cc_entrypoint=sdk-cli; cch={cch};"},
                {"type": "text", "text": SYSTEM + " Volatile-byte test."}]

    messages = [{"role": "user", "content": "Which port does HTTP use?"}]
    assert count(server, messages, system=system("0a1b2")) == \
        count(server, messages, system=system("ffee9"))
    m1 = create(server, messages, system=system("11111"), max_tokens=2)
    m2 = create(server, messages, system=system("22222"), max_tokens=2)
    assert prompt_len(m1.usage) == prompt_len(m2.usage)
    assert (m2.usage.cache_read_input_tokens or 0) >= reusable(prompt_len(m2.usage))
    assert "x-anthropic-billing-header" in server.get_json("/props")["volatile_patterns"][0]


# --- tools ---------------------------------------------------------------------------------


def check_weather_input(value: object) -> None:
    """WEATHER's schema, checked by hand: required keys, types, enum, no extra keys."""
    assert isinstance(value, dict)
    assert set(value) == {"city", "unit"}
    assert isinstance(value["city"], str)
    assert value["unit"] in ("celsius", "fahrenheit")


def test_forced_named_tool(server: Server) -> None:
    other = {"name": "get_time", "description": "Get the time in a timezone.",
             "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}
    msg = create(server, [{"role": "user", "content": "What's the weather like in Paris?"}],
                 tools=[other, WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                 max_tokens=64)
    assert msg.stop_reason == "tool_use"
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].id.startswith("toolu_")
    check_weather_input(calls[0].input)


def test_forced_tool_streams_input_json(server: Server) -> None:
    with client(server).messages.stream(
            model="m", max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
            tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "Weather in Oslo, please."}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert final.stop_reason == "tool_use"
    (call,) = [b for b in final.content if b.type == "tool_use"]
    check_weather_input(call.input)
    assert json.loads("".join(d.partial_json for d in deltas)) == call.input  # type: ignore


def test_tool_result_turn(server: Server) -> None:
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "c2ln"},
            {"type": "redacted_thinking", "data": "b3BhcXVl"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
             "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "Sunny, 21 degrees."}]}]},
    ]
    msg = create(server, history, tools=[WEATHER], max_tokens=24)
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert prompt_len(msg.usage) == count(server, history, tools=[WEATHER])
    # the result's text is in the prompt: a longer result makes a longer prompt
    longer = json.loads(json.dumps(history))
    longer[2]["content"][0]["content"] = "Sunny, 21 degrees, light wind from the north."
    assert count(server, longer, tools=[WEATHER]) > prompt_len(msg.usage)
    # a string result with is_error renders too
    failed = json.loads(json.dumps(history))
    failed[2]["content"] = [{"type": "tool_result", "tool_use_id": "toolu_01",
                             "content": "city not found", "is_error": True},
                            {"type": "text", "text": "Try again with London."}]
    assert count(server, failed, tools=[WEATHER]) > 0


def test_mid_conversation_system_message_merges_into_the_user_turn(server: Server) -> None:
    with_system = [
        {"role": "user", "content": "Hi there."},
        {"role": "system", "content": "The user prefers short answers."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is DNS?"},
    ]
    merged = [
        {"role": "user", "content": "Hi there.\n\nThe user prefers short answers."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is DNS?"},
    ]
    assert count(server, with_system, system=SYSTEM) == count(server, merged, system=SYSTEM)
    msg = create(server, with_system, system=SYSTEM, max_tokens=8)
    assert msg.content and msg.usage.output_tokens > 0


def test_a_final_assistant_turn_is_continued(server: Server) -> None:
    """As on the API, a conversation that ends in an assistant turn is continued: the reply
    is what a raw completion of the same text, with that turn left open, generates."""
    msgs = [{"role": "user", "content": "List the first five prime numbers."},
            {"role": "assistant", "content": "The first five prime numbers are 2, 3"}]
    msg = create(server, msgs, system="You are a math tutor.", max_tokens=12)
    open_turn = ("<|im_start|>system\nYou are a math tutor.<|im_end|>\n<|im_start|>user\n"
                 "List the first five prime numbers.<|im_end|>\n<|im_start|>assistant\n"
                 "The first five prime numbers are 2, 3")
    raw = openai.OpenAI(base_url=server.v1, api_key="test-key", max_retries=0,
                        timeout=600).completions.create(model="m", prompt=open_turn,
                                                        max_tokens=12, temperature=0)
    assert msg.content[0].text == raw.choices[0].text  # type: ignore[union-attr]
    assert prompt_len(msg.usage) == raw.usage.prompt_tokens == count(
        server, msgs, system="You are a math tutor.")


# --- errors --------------------------------------------------------------------------------


BAD = [
    # (body, expected fragment of the message)
    (b"{not json", "not valid JSON"),
    ({"model": "m", "max_tokens": 5}, "'messages' is required"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is required"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
     "role must be user or assistant"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]}, "an assistant turn takes"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "any"}}, "no 'tools'"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": "Sure, "}]},
     "cannot end with trailing whitespace"),
]


@pytest.mark.parametrize("body,fragment", BAD)
def test_bad_input_is_a_400_in_anthropic_shape(server: Server, body: dict | bytes,
                                                fragment: str) -> None:
    status, _, raw = post_raw(server, "/v1/messages", body)
    assert status == 400
    err = json.loads(raw)
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"], err["error"]["message"]


def test_prompt_too_long_says_so_the_way_claude_code_reads_it(server: Server) -> None:
    long = "word " * (N_CTX + 200)
    with pytest.raises(anthropic.BadRequestError) as exc:
        create(server, [{"role": "user", "content": long}])
    message = exc.value.body["error"]["message"]  # type: ignore[index]
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {N_CTX} maximum", message)
    n = int(message.split()[4])
    assert count(server, [{"role": "user", "content": long}]) == n
    assert not any(w["busy"] for w in server.get_json("/health")["workers"])


# --- a strict server: API keys, fast pings -------------------------------------------------


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("strict")
    keys = tmp / "keys.txt"
    keys.write_text("good-key\n")
    with running(tmp, "--workers", "1", "--api-keys", str(keys), "--ping-interval-s", "0.2",
                 "--disk-prefix-cache", "off") as srv:
        yield srv


def test_api_keys(strict: Server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as exc:
        create(strict, [{"role": "user", "content": "hi"}], max_tokens=1)
    assert exc.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    ok = client(strict, "good-key").messages.create(
        model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.output_tokens == 1
    status, _, _ = post_raw(strict, "/v1/messages", {"model": "m", "max_tokens": 1,
                            "messages": [{"role": "user", "content": "hi"}]},
                            {"Authorization": "Bearer good-key"})
    assert status == 200


def test_pings_flow_while_a_long_prefill_runs(strict: Server) -> None:
    """After message_start comes one ping at once; after that, until the first content block
    (the first token, which only the end of the prefill brings), a ping goes out each silent
    interval: a ping in between was sent while the prefill ran. A faster machine needs a longer
    prompt for its prefill to outlast one interval (0.2 s here), so the prompt grows until it
    does; each starts differently, so none reuses the previous one's live prefix."""
    for n_lines in (40, 80, 160):  # about 700, 1,400 and 2,800 tokens
        text = f"Take {n_lines}. " + " ".join(
            f"Line {i}: the proxy keeps the prefix of request {i * 7}." for i in range(n_lines))
        status, _, raw = post_raw(strict, "/v1/messages", {
            "model": "m", "max_tokens": 2, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}, {"x-api-key": "good-key"})
        assert status == 200
        names = [e for e, _ in sse_events(raw)]
        first_block = names.index("content_block_start")
        assert names[:2] == ["message_start", "ping"], names
        assert set(names[2:first_block]) <= {"ping"}, names
        assert names[-1] == "message_stop", names
        if first_block > 2:
            return  # pings went out during the prefill
    pytest.fail(f"no ping while {n_lines} lines were prefilled: {names}")


def test_worker_dying_mid_stream_is_an_error_event(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--workers", "1", "--disk-prefix-cache", "off")
    try:
        pid = int(re.findall(r"ready \(pid (\d+)", srv.log())[-1])
        stream = client(srv).messages.create(
            model="m", max_tokens=400, stream=True, extra_body={"temperature": 0.8},
            messages=[{"role": "user", "content": "Write a very long story about a cat."}])
        seen: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as exc:
            for ev in stream:
                seen.append(ev.type)
                if ev.type == "content_block_delta" and seen.count(ev.type) == 2:
                    os.kill(pid, signal.SIGKILL)
        assert "message_stop" not in seen
        assert exc.value.body["type"] == "error"  # type: ignore[index]
        assert exc.value.body["error"]["type"] in ("overloaded_error", "api_error")  # type: ignore
    finally:
        srv.stop()
