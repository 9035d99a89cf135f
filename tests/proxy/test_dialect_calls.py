"""A forced tool call through each of llama.cpp's fixture templates (`--chat-template-file`)
with the default model, over both APIs and their official SDKs: the model writes the call in
that template's dialect (the grammar says how), prefixgate parses it back, and the SDKs get a
tool call whose arguments are valid against the schema. The Anthropic call is streamed, so
its arguments arrive as `input_json_delta` pieces the SDK joins."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Server, running
from tests.proxy.test_dialects import DETECT, TEMPLATES

pytestmark = pytest.mark.model

# the path is bounded: a 135M model otherwise rambles inside a string it is forced to write
SCHEMA = {"type": "object",
          "properties": {"path": {"type": "string", "maxLength": 48},
                         "limit": {"type": "integer"},
                         "mode": {"type": "string", "enum": ["head", "tail"]}},
          "required": ["path", "limit", "mode"], "additionalProperties": False}
DESCRIPTION = "Read lines of a file."
MESSAGES = [{"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Show me the first 20 lines of main.py"}]


def valid(args: dict[str, Any]) -> bool:
    """`args` against SCHEMA (the few keywords it uses)."""
    return (set(args) == {"path", "limit", "mode"} and isinstance(args["path"], str)
            and len(args["path"]) <= 48
            and isinstance(args["limit"], int) and not isinstance(args["limit"], bool)
            and args["mode"] in ("head", "tail"))


@pytest.fixture(scope="module", params=list(DETECT))
def templated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[str, Server]]:
    name = request.param
    with running(tmp_path_factory.mktemp("tpl"), "--disk-prefix-cache", "off",
                 "--chat-template-file", str(Path(TEMPLATES) / f"{name}.jinja")) as srv:
        yield name, srv


def test_forced_call_over_the_openai_api(templated: tuple[str, Server]) -> None:
    name, srv = templated
    c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=600)
    r = c.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=160, temperature=0,  # type: ignore[arg-type]
        tools=[{"type": "function", "function": {"name": "read_file", "description": DESCRIPTION,
                                                 "parameters": SCHEMA}}],
        tool_choice={"type": "function", "function": {"name": "read_file"}})
    choice = r.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls", (name, choice.message.content)
    assert [c.function.name for c in calls] == ["read_file"]  # type: ignore[union-attr]
    assert valid(json.loads(calls[0].function.arguments)), calls  # type: ignore[union-attr]
    assert f"tool dialect {DETECT[name][0]}" in srv.log()


def test_forced_call_over_the_anthropic_api_streamed(templated: tuple[str, Server]) -> None:
    name, srv = templated
    c = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0, timeout=600)
    # 256: without `thinking` GLM-4.6's template writes /nothink and an empty think block,
    # after which the default model takes 168 tokens for this call
    with c.messages.stream(
            model="m", system=MESSAGES[0]["content"], max_tokens=256,
            extra_body={"temperature": 0},  # this SDK's stream() takes no temperature
            messages=[MESSAGES[1]],  # type: ignore[list-item]
            tools=[{"name": "read_file", "description": DESCRIPTION,  # type: ignore[list-item]
                    "input_schema": SCHEMA}],
            tool_choice={"type": "any"}) as stream:
        message = stream.get_final_message()
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use", (name, message.content)
    assert [u.name for u in uses] == ["read_file"]
    assert valid(uses[0].input), uses  # type: ignore[arg-type]


# --- reasoning, through a template that opens it: Qwen3.5's -----------------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("think"), "--disk-prefix-cache", "off",
                 "--chat-template-file", str(Path(TEMPLATES) / "Qwen3.5-4B.jinja")) as srv:
        yield srv


def test_reasoning_is_separated_on_the_openai_api(thinking: Server) -> None:
    """Qwen3.5's generation prompt opens `<think>`: what the model writes is reasoning (this
    model never closes it); with enable_thinking off the template closes it, and it is text."""
    c = openai.OpenAI(base_url=thinking.v1, api_key="k", max_retries=0, timeout=600)
    r = c.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore[arg-type]
                                  max_tokens=12, temperature=0)
    m = r.choices[0].message
    assert m.content is None or m.content == ""
    assert getattr(m, "reasoning_content", "")  # the llama-server / vLLM field
    details = r.usage.completion_tokens_details  # never closed: every token is reasoning
    assert details is not None and details.reasoning_tokens == r.usage.completion_tokens == 12
    deltas = [ch.choices[0].delta for ch in c.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=12, temperature=0,  # type: ignore[arg-type]
        stream=True) if ch.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == m.reasoning_content  # type: ignore[attr-defined]
    off = c.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore[arg-type]
                                    max_tokens=12, temperature=0,
                                    extra_body={"chat_template_kwargs":
                                                {"enable_thinking": False}})
    assert off.choices[0].message.content
    assert not getattr(off.choices[0].message, "reasoning_content", None)
    assert off.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_a_reasoning_budget_forces_the_end_of_reasoning(thinking: Server,
                                                        sampling: dict[str, Any]) -> None:
    """llama-server's reasoning budget: after N reasoning tokens the closing tag is forced
    (after the budget's message), so the reasoning is the first N tokens of the unbounded
    run's, and what follows is the answer. Greedy, and seeded through the sampler chain; the
    request's field, Anthropic's `thinking.budget_tokens`, and 0 (closed at once)."""
    c = openai.OpenAI(base_url=thinking.v1, api_key="k", max_retries=0, timeout=600)

    def ask(**extra: Any) -> Any:
        return c.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore[arg-type]
                                         max_tokens=16, extra_body={**sampling, **extra})
    free = ask().choices[0].message.reasoning_content
    cut = ask(reasoning_budget_tokens=4, reasoning_budget_message=" Enough.")
    m, details = cut.choices[0].message, cut.usage.completion_tokens_details
    assert m.reasoning_content.endswith(" Enough.") and free.startswith(
        m.reasoning_content.removesuffix(" Enough.")), (free, m.reasoning_content)
    assert len(m.reasoning_content.removesuffix(" Enough.")) < len(free)
    # the reasoning's tokens: 4 of the model's, the message's and the closing tag's
    assert details is not None and 4 < details.reasoning_tokens < cut.usage.completion_tokens
    assert ask(thinking_budget_tokens=4).choices[0].message.reasoning_content == \
        m.reasoning_content.removesuffix(" Enough."), "llama-server's other name for it"
    at_once = ask(reasoning_budget_tokens=0).choices[0].message
    assert not getattr(at_once, "reasoning_content", None) and at_once.content
    if sampling["temperature"]:
        return  # Anthropic's API takes no seed
    an = anthropic.Anthropic(base_url=thinking.url, api_key="k", max_retries=0, timeout=600)
    thought = [an.messages.create(
        model="m", max_tokens=16, messages=[MESSAGES[1]],  # type: ignore[list-item]
        thinking={"type": "enabled", "budget_tokens": n}, extra_body=sampling).content[0]
        for n in (1024, 4)]
    assert [b.type for b in thought] == ["thinking", "thinking"]
    long, short = (b.thinking for b in thought)  # type: ignore[union-attr]
    assert long.startswith(short) and len(short) < len(long), (long, short)


@pytest.mark.parametrize(("pieces", "end", "expected"), [
    (["<think>", "a", "b", "</think>", "x"], "</think>", 4),  # up to the closing token
    (["a", "</", "think>", "x", "y"], "</think>", 3),  # a tag split over two tokens
    (["a", "b"], "</think>", 2),  # never closed (cut by max_tokens): all of it
    (["<|channel|>", "analysis", "<|message|>", "hm", "<|end|>", "<|start|>"], "<|end|>", 5),
])
def test_reasoning_tokens_count_up_to_the_close(pieces: list[str], end: str,
                                                expected: int) -> None:
    from proxy.openai_api import reasoning_tokens

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids)
    assert reasoning_tokens(decode, list(range(len(pieces))), end) == expected


def test_thinking_blocks_on_the_anthropic_api(thinking: Server) -> None:
    c = anthropic.Anthropic(base_url=thinking.url, api_key="k", max_retries=0, timeout=600)
    with c.messages.stream(model="m", max_tokens=12, messages=[MESSAGES[1]],  # type: ignore
                           thinking={"type": "enabled", "budget_tokens": 1024},
                           extra_body={"temperature": 0}) as stream:
        kinds = [e.content_block.type for e in stream if e.type == "content_block_start"]
        message = stream.get_final_message()
    assert kinds == ["thinking"] and message.content[0].type == "thinking"
    assert message.content[0].thinking  # type: ignore[union-attr]
    off = c.messages.create(model="m", max_tokens=12, messages=[MESSAGES[1]],  # type: ignore
                            thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert [b.type for b in off.content] == ["text"]
    # without `thinking` it is off, as Anthropic's API treats it: the template closes it
    default = c.messages.create(model="m", max_tokens=12, messages=[MESSAGES[1]],  # type: ignore
                                extra_body={"temperature": 0})
    assert [b.type for b in default.content] == ["text"]
    assert default.content[0].text == off.content[0].text  # type: ignore[union-attr]
    # thinking sent back in the history reaches the prompt (Qwen3.5 keeps it after the last
    # user message)
    history = [MESSAGES[1], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Read it with the tool.", "signature": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file",
         "input": {"path": "main.py", "limit": 20, "mode": "head"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "print(1)"}]}]
    tools = [{"name": "read_file", "description": DESCRIPTION, "input_schema": SCHEMA}]
    with_thought = c.messages.count_tokens(model="m", messages=history,  # type: ignore
                                           tools=tools).input_tokens  # type: ignore[arg-type]
    history[1]["content"] = history[1]["content"][1:]  # type: ignore[index]
    without = c.messages.count_tokens(model="m", messages=history,  # type: ignore
                                      tools=tools).input_tokens  # type: ignore[arg-type]
    assert with_thought > without


@pytest.mark.parametrize("max_tokens", [2, 9])
def test_a_forced_call_cut_by_max_tokens_is_still_a_call(templated: tuple[str, Server],
                                                         max_tokens: int) -> None:
    """Cut in its markup or name (2 tokens) or in its arguments (9): a tool call with the
    arguments that completed and finish_reason "length", never the raw markup as content."""
    name, srv = templated
    c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=600)
    tools = [{"type": "function", "function": {"name": "read_file", "description": DESCRIPTION,
                                               "parameters": SCHEMA}}]
    r = c.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=max_tokens, temperature=0,  # type: ignore
        tools=tools, tool_choice={"type": "function", "function": {"name": "read_file"}})
    choice = r.choices[0]
    assert choice.finish_reason == "length", (name, choice)
    assert not choice.message.content, (name, choice.message.content)
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["read_file"], (name, choice)  # type: ignore
    args = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
    assert set(args) <= {"path", "limit", "mode"}, (name, args)
    streamed = list(c.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=max_tokens, temperature=0,  # type: ignore
        tools=tools, tool_choice={"type": "function", "function": {"name": "read_file"}},
        stream=True))
    deltas = [ch.choices[0].delta for ch in streamed if ch.choices]
    assert not "".join(d.content or "" for d in deltas), name
    assert [d.tool_calls[0].function.name for d in deltas  # type: ignore[index,union-attr]
            if d.tool_calls and d.tool_calls[0].function.name] == ["read_file"]
    assert streamed[-1].choices[0].finish_reason == "length"
