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
    with c.messages.stream(
            model="m", system=MESSAGES[0]["content"], max_tokens=160,
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
